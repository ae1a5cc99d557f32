-- Rebuild one sale's Redis state from Postgres, keeping the orders still in flight.
--
-- KEYS[1] voucher state hash  KEYS[2] buyers hash  KEYS[3] the shard's pending hash
-- ARGV[1] voucher_id  ARGV[2] Postgres remaining stock  ARGV[3] begin_ms  ARGV[4] end_ms
-- ARGV[5] expire_at_ms  ARGV[6..] pairs user_id, order_id of the orders Postgres holds
--
-- Buyers become: Postgres's buyers plus the users whose orders are admitted and not
-- yet written (pending records). Stock becomes Postgres's stock minus those in-flight
-- orders. Buyers whose orders were dead-lettered are dropped: they hold no order.
-- Returns {stock, buyers, in_flight}.
local prefix = ARGV[1] .. ':'
local in_pg = {}
local buyers = {}
for i = 6, #ARGV, 2 do
  in_pg[ARGV[i]] = true
  buyers[#buyers + 1] = ARGV[i]
  buyers[#buyers + 1] = ARGV[i + 1]
end

local in_flight = 0
local pending = redis.call('HGETALL', KEYS[3])
for i = 1, #pending, 2 do
  local value = pending[i + 1]
  if string.sub(value, 1, #prefix) == prefix then
    local user = string.match(string.sub(value, #prefix + 1), '^(%d+):')
    if user and not in_pg[user] then
      in_pg[user] = true
      buyers[#buyers + 1] = user
      buyers[#buyers + 1] = pending[i]
      in_flight = in_flight + 1
    end
  end
end

local stock = tonumber(ARGV[2]) - in_flight
if stock < 0 then
  stock = 0
end

redis.call('DEL', KEYS[2])
for i = 1, #buyers, 1000 do
  redis.call('HSET', KEYS[2], unpack(buyers, i, math.min(i + 999, #buyers)))
end
redis.call('HSET', KEYS[1], 'stock', stock, 'begin_ms', ARGV[3], 'end_ms', ARGV[4])
redis.call('PEXPIREAT', KEYS[1], ARGV[5])
if #buyers > 0 then
  redis.call('PEXPIREAT', KEYS[2], ARGV[5])
end
return {stock, #buyers / 2, in_flight}
