-- Flash-sale admission: every check and every write of one "grab" in one atomic step.
--
-- All keys share one hash tag (the voucher's shard), so this is valid on Redis Cluster.
-- KEYS[1] voucher state hash: stock, begin_ms, end_ms
-- KEYS[2] buyers hash: user_id -> order_id
-- KEYS[3] the shard's order stream (stream.orders)
-- KEYS[4] the shard's pending hash: order_id -> "voucher_id:user_id:admitted_ms"
-- KEYS[5] the user's pending hash in this shard: order_id -> "voucher_id:admitted_ms"
-- ARGV[1] voucher_id  ARGV[2] user_id  ARGV[3] order_id (minted by the API)
--
-- Returns {code} or {code, order_id}:
--   0 admitted (order_id), 1 not loaded, 2 not started, 3 ended,
--   4 already ordered (the existing order_id), 5 sold out
local v = redis.call('HMGET', KEYS[1], 'stock', 'begin_ms', 'end_ms')
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

local prev = redis.call('HGET', KEYS[2], ARGV[2])
if prev then
  return {4, prev}
end

if tonumber(v[1]) <= 0 then
  return {5}
end

redis.call('HINCRBY', KEYS[1], 'stock', -1)
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
-- The first buyer creates the buyers hash: it expires with the sale's state.
if redis.call('PTTL', KEYS[2]) == -1 then
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then
    redis.call('PEXPIRE', KEYS[2], ttl)
  end
end
redis.call('XADD', KEYS[3], '*',
  'order_id', ARGV[3], 'voucher_id', ARGV[1], 'user_id', ARGV[2], 'admitted_ms', now)
redis.call('HSET', KEYS[4], ARGV[3], ARGV[1] .. ':' .. ARGV[2] .. ':' .. now)
redis.call('HSET', KEYS[5], ARGV[3], ARGV[1] .. ':' .. now)
return {0, ARGV[3]}
