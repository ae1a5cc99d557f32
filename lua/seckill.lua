-- Flash-sale admission: every check and every write of each "grab" in one atomic step.
--
-- Grabs that arrive together for one shard are decided by one call, one after the
-- other, each exactly as if it ran alone (a user's second grab in the same call sees the
-- first): coalescing saves Redis the per-call cost (script lookup, argument parsing,
-- reply), which was most of its work per grab.
--
-- A sale is one hash: `stock`, `begin_ms`, `end_ms`, and a field `u:<user_id>` holding
-- the order id of each buyer (so buyer records expire with the sale). All keys share
-- the shard's hash tag, so this is valid on Redis Cluster.
-- KEYS[1] the shard's order stream (stream.orders)  KEYS[2..] the sale hashes
-- ARGV: per grab four values: index of its sale hash in KEYS, voucher_id, user_id,
-- order_id (minted by the API)
--
-- Returns, per grab, two values: code, order_id (0 when none):
--   0 admitted (order_id), 1 not loaded, 2 not started, 3 ended,
--   4 already ordered (the existing order_id), 5 sold out
--
-- The layout (buyer prefix, entry fields) is the one src/keys.rs defines; a unit test
-- there keeps this script in step.
local t = redis.call('TIME')
-- One clock for every API instance: the Redis server's.
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Each sale is read once per call; its stock is written back once, at the end.
local sales = {}
local out = {}
for i = 1, #ARGV, 4 do
  local k = tonumber(ARGV[i])
  local key = KEYS[k]
  local user, order = ARGV[i + 2], ARGV[i + 3]
  local s = sales[k]
  if not s then
    local v = redis.call('HMGET', key, 'stock', 'begin_ms', 'end_ms')
    -- A missing field means the state is gone (restart, flush, expiry): fail closed,
    -- never treat a missing stock as "unlimited".
    if not v[1] or not v[2] or not v[3] then
      s = {closed = 1}
    elseif now < tonumber(v[2]) then
      s = {closed = 2}
    elseif now >= tonumber(v[3]) then
      s = {closed = 3}
    else
      s = {stock = tonumber(v[1]), taken = 0}
    end
    sales[k] = s
  end
  local code, id = 0, 0
  local buyer = 'u:' .. user
  if s.closed then
    code = s.closed
  elseif s.stock - s.taken <= 0 then
    -- Sold out, unless this user already holds an order (that answer comes first).
    local held = redis.call('HGET', key, buyer)
    if held then
      code, id = 4, held
    else
      code = 5
    end
  elseif redis.call('HSETNX', key, buyer, order) == 0 then
    code, id = 4, redis.call('HGET', key, buyer)
  else
    s.taken = s.taken + 1
    redis.call('XADD', KEYS[1], '*',
      'order_id', order, 'voucher_id', ARGV[i + 1], 'user_id', user, 'admitted_ms', now)
    id = order
  end
  out[#out + 1] = code
  out[#out + 1] = id
end
for k, s in pairs(sales) do
  if s.taken and s.taken > 0 then
    redis.call('HSET', KEYS[k], 'stock', s.stock - s.taken)
  end
end
return out
