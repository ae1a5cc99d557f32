-- Flash-sale admission: every check and every write of one "grab" in one atomic step.
--
-- A sale is one hash: `stock`, `begin_ms`, `end_ms`, and a field `u:<user_id>` holding
-- the order id of each buyer (so buyer records expire with the sale).
-- Both keys share one hash tag (the voucher's shard), so this is valid on Redis Cluster.
-- KEYS[1] the sale hash
-- KEYS[2] the shard's order stream (stream.orders)
-- ARGV[1] voucher_id  ARGV[2] user_id  ARGV[3] order_id (minted by the API)
--
-- Returns {code} or {code, order_id}:
--   0 admitted (order_id), 1 not loaded, 2 not started, 3 ended,
--   4 already ordered (the existing order_id), 5 sold out
--
-- The layout (buyer prefix, entry fields) is the one src/keys.rs defines; a unit test
-- there keeps this script in step.
--
-- Kept to four commands: this script is most of Redis's work during a sale.
local buyer = 'u:' .. ARGV[2]
local v = redis.call('HMGET', KEYS[1], 'stock', 'begin_ms', 'end_ms', buyer)
-- A missing field means the state is gone (restart, flush, expiry): fail closed,
-- never treat a missing stock as "unlimited".
if not v[1] or not v[2] or not v[3] then
  return {1}
end

-- One clock for every API instance: the Redis server's.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if now < tonumber(v[2]) then
  return {2}
end
if now >= tonumber(v[3]) then
  return {3}
end

if v[4] then
  return {4, v[4]}
end

local stock = tonumber(v[1])
if stock <= 0 then
  return {5}
end

redis.call('HSET', KEYS[1], 'stock', stock - 1, buyer, ARGV[3])
redis.call('XADD', KEYS[2], '*',
  'order_id', ARGV[3], 'voucher_id', ARGV[1], 'user_id', ARGV[2], 'admitted_ms', now)
return {0, ARGV[3]}
