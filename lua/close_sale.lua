-- Ends a sale now (an administrator's close). Atomic with admission: a grab decided
-- before this script is admitted as usual, every grab after it hears `ended`.
--
-- end_ms becomes the Redis clock's now (the clock admission uses) unless it is already
-- earlier; begin_ms at most one millisecond before it, so a sale closed before it
-- opened reads as ended, never as about to open.
-- KEYS[1] the sale hash
-- Returns the sale's end in ms (the Redis clock's now when the sale is not loaded).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HMGET', KEYS[1], 'begin_ms', 'end_ms')
if not cur[1] or not cur[2] then
  return now
end
local finish = math.min(tonumber(cur[2]), now)
local begin = math.min(tonumber(cur[1]), finish - 1)
redis.call('HSET', KEYS[1], 'end_ms', string.format('%d', finish), 'begin_ms', string.format('%d', begin))
return finish
