-- Load (or rebuild) one sale's Redis state from Postgres.
--
-- KEYS[1] the sale hash  KEYS[2] the shard's pending hash
-- ARGV[1] mode: 'create' (a new sale: load if missing; nothing can be in flight yet),
--         'load' (load if missing, counting orders in flight), 'repair' (overwrite)
-- ARGV[2] voucher_id  ARGV[3] Postgres remaining stock  ARGV[4] begin_ms  ARGV[5] end_ms
-- ARGV[6] expire_at_ms  ARGV[7..] pairs user_id, order_id of the orders Postgres holds
--
-- Buyers become Postgres's buyers plus the users whose orders are admitted and not yet
-- written (the pending records of this voucher); stock becomes Postgres's stock minus
-- those in-flight orders. Buyers whose orders were dead-lettered are dropped: they hold
-- no order. Returns {-1} when live state was left alone, else {stock, buyers, in_flight}.
local mode = ARGV[1]
if mode ~= 'repair' and redis.call('EXISTS', KEYS[1]) == 1 then
  return {-1}
end

local fields = {}
local in_pg = {}
for i = 7, #ARGV, 2 do
  in_pg[ARGV[i]] = true
  fields[#fields + 1] = 'u:' .. ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
end

-- O(pending orders of the shard): loading and repair are rare, admission never does it.
local prefix = ARGV[2] .. ':'
local in_flight = 0
local pending = {}
if mode ~= 'create' then
  pending = redis.call('HGETALL', KEYS[2])
end
for i = 1, #pending, 2 do
  local value = pending[i + 1]
  if string.sub(value, 1, #prefix) == prefix then
    local user = string.match(string.sub(value, #prefix + 1), '^(%d+):')
    if user and not in_pg[user] then
      in_pg[user] = true
      fields[#fields + 1] = 'u:' .. user
      fields[#fields + 1] = pending[i]
      in_flight = in_flight + 1
    end
  end
end

local stock = tonumber(ARGV[3]) - in_flight
if stock < 0 then
  stock = 0
end

redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'stock', stock, 'begin_ms', ARGV[4], 'end_ms', ARGV[5])
for i = 1, #fields, 1000 do
  redis.call('HSET', KEYS[1], unpack(fields, i, math.min(i + 999, #fields)))
end
redis.call('PEXPIREAT', KEYS[1], ARGV[6])
return {stock, #fields / 2, in_flight}
