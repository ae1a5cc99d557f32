-- Give a closed (cancelled or expired) order's unit back to the sale's live stock and
-- release its buyer, so the user may grab again.
--
-- Acts only while the buyer record still names this order: such a record means the
-- order's unit is still out in Redis (admission and loading set a record only together
-- with taking the unit, and a load after the order closed never names it, since it
-- counts Postgres's active orders and returned stock). Deleting the record is what
-- makes the unit come back once: a retry, the outbox drain or a replay finds no record
-- naming the order and changes nothing.
--
-- KEYS[1] the sale hash  ARGV[1] buyer field  ARGV[2] the closed order's id
-- Returns 1 when the unit went back, 0 when there was nothing to release.
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('HEXISTS', KEYS[1], 'stock') == 1 then
  redis.call('HINCRBY', KEYS[1], 'stock', 1)
  -- A unit came back: API instances that remember the sale sold out must look again.
  redis.call('HINCRBY', KEYS[1], 'gen', 1)
end
return 1
