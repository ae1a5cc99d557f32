-- Settle a dead (never-to-be-written) order in Redis: if its buyer record still names
-- it, hand the user's record back to the order Postgres holds for them (or drop it) and
-- return the unit the order took.
--
-- One atomic step, so the unit comes back exactly once: a buyer record naming the
-- dead order means its unit is still out (admission and loading set such a record
-- only together with taking the unit), and this script is the only place that changes
-- that record back. Its stream entry is acknowledged later, with the batch (an entry
-- holds the orders of one admission call): a loader meanwhile finds the order buried
-- in Postgres (under the sale's lock, where burial happens) and does not count it.
--
-- KEYS[1] the sale hash
-- ARGV[1] buyer field  ARGV[2] the dead order id
-- ARGV[3] the order Postgres holds for the user ('' if none)  ARGV[4] '1': return the unit
-- Returns 1 when the buyer record was settled, 0 when it no longer named the order.
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return 0
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
if ARGV[4] == '1' and redis.call('HEXISTS', KEYS[1], 'stock') == 1 then
  redis.call('HINCRBY', KEYS[1], 'stock', 1)
  -- A unit came back: API instances that remember the sale sold out must look again.
  redis.call('HINCRBY', KEYS[1], 'gen', 1)
end
return 1
