-- Load one voucher's flash-sale state from Postgres into Redis, unless live state exists.
--
-- KEYS[1] voucher state hash  KEYS[2] buyers hash
-- ARGV[1] Postgres remaining stock  ARGV[2] begin_ms  ARGV[3] end_ms  ARGV[4] expire_at_ms
-- ARGV[5..] pairs user_id, order_id of the orders Postgres holds
--
-- Returns -1 when live state was already there (it is never overwritten), else the
-- stock that was loaded.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return -1
end

local persisted = 0
for i = 5, #ARGV, 2 do
  redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1])
  persisted = persisted + 1
end

-- Buyers that survived in Redis but are not in Postgres yet are admitted orders still
-- on their way through the stream: their units are gone too. (A stale one only makes
-- us sell less, never more.)
local in_flight = redis.call('HLEN', KEYS[2]) - persisted
local stock = tonumber(ARGV[1]) - in_flight
if stock < 0 then
  stock = 0
end

redis.call('HSET', KEYS[1], 'stock', stock, 'begin_ms', ARGV[2], 'end_ms', ARGV[3])
redis.call('PEXPIREAT', KEYS[1], ARGV[4])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('PEXPIREAT', KEYS[2], ARGV[4])
end
return stock
