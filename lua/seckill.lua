-- Flash-sale admission: every check and every write of each "grab" in one atomic step.
--
-- Grabs that arrive together for one shard are decided by one call, one after the
-- other, each exactly as if it ran alone (a user's second grab in the same call sees the
-- first): coalescing saves Redis the per-call cost (script lookup, argument parsing,
-- reply), which was most of its work per grab. For the same reason each sale is read
-- with ONE HMGET (its state and the buyer records of every user in the call) and
-- written with ONE HSET (stock and the new buyers); only the XADD is per order. The
-- script is atomic, so nobody can change a record between that read and that write.
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
-- One clock for every API instance: the Redis server's. Formatted once per call
-- (turning a Lua number into a string goes through printf).
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_s = string.format('%d', now)

-- The grabs of each sale, and the fields to read for it.
local sales = {}
local order_of_sales = {}
for i = 1, #ARGV, 4 do
  local k = ARGV[i]
  local s = sales[k]
  if not s then
    s = {key = KEYS[tonumber(k)], fields = {'stock', 'begin_ms', 'end_ms'}, held = {}, new = {}}
    sales[k] = s
    order_of_sales[#order_of_sales + 1] = s
  end
  s.fields[#s.fields + 1] = 'u:' .. ARGV[i + 2]
end
for _, s in ipairs(order_of_sales) do
  local v = redis.call('HMGET', s.key, unpack(s.fields))
  -- A missing field means the state is gone (restart, flush, expiry): fail closed,
  -- never treat a missing stock as "unlimited".
  if not v[1] or not v[2] or not v[3] then
    s.closed = 1
  elseif now < tonumber(v[2]) then
    s.closed = 2
  elseif now >= tonumber(v[3]) then
    s.closed = 3
  else
    s.stock = tonumber(v[1])
  end
  for j = 4, #s.fields do
    if v[j] then
      s.held[s.fields[j]] = v[j]
    end
  end
end

local out = {}
for i = 1, #ARGV, 4 do
  local s = sales[ARGV[i]]
  local user, order = ARGV[i + 2], ARGV[i + 3]
  local buyer = 'u:' .. user
  local held = s.held[buyer]
  local code, id = 0, 0
  if s.closed then
    code = s.closed
  elseif held then
    -- Already ordered comes before sold out.
    code, id = 4, held
  elseif s.stock <= 0 then
    code = 5
  else
    s.stock = s.stock - 1
    s.held[buyer] = order
    s.new[#s.new + 1] = buyer
    s.new[#s.new + 1] = order
    redis.call('XADD', KEYS[1], '*',
      'order_id', order, 'voucher_id', ARGV[i + 1], 'user_id', user, 'admitted_ms', now_s)
    id = order
  end
  out[#out + 1] = code
  out[#out + 1] = id
end
for _, s in ipairs(order_of_sales) do
  if #s.new > 0 then
    redis.call('HSET', s.key, 'stock', s.stock, unpack(s.new))
  end
end
return out
