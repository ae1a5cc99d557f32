-- Settle a dead (never-to-be-written) order in Redis: acknowledge its stream entry,
-- and, if its buyer record still names it, hand the user's record back to the order
-- Postgres holds for them (or drop it) and return the unit the order took.
--
-- One atomic step, so the unit comes back exactly once: a buyer record naming the
-- dead order means its unit is still out (admission and loading set such a record
-- only together with taking the unit), and this script is the only place that changes
-- that record back. A loader that runs before it sees the entry unacknowledged and
-- counts it; one that runs after sees it acknowledged and does not.
--
-- KEYS[1] the sale hash  KEYS[2] the shard's order stream
-- ARGV[1] consumer group  ARGV[2] entry id  ARGV[3] buyer field  ARGV[4] the dead order id
-- ARGV[5] the order Postgres holds for the user ('' if none)  ARGV[6] '1': return the unit
-- Returns 1 when the buyer record was settled, 0 when it no longer named the order.
redis.pcall('XACK', KEYS[2], ARGV[1], ARGV[2])
if redis.call('HGET', KEYS[1], ARGV[3]) ~= ARGV[4] then
  return 0
end
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[3], ARGV[5])
else
  redis.call('HDEL', KEYS[1], ARGV[3])
end
if ARGV[6] == '1' and redis.call('HEXISTS', KEYS[1], 'stock') == 1 then
  redis.call('HINCRBY', KEYS[1], 'stock', 1)
  -- A unit came back: API instances that remember the sale sold out must look again.
  redis.call('HINCRBY', KEYS[1], 'gen', 1)
end
return 1
