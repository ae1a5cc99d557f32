-- Acknowledge orders the worker has committed to Postgres (or dead-lettered), and
-- forget their pending records.
--
-- KEYS[1] the shard's stream  KEYS[2] the shard's pending hash
-- ARGV[1] consumer group  ARGV[2..] pairs stream_entry_id, order_id ('' if unknown)
-- Returns the number of entries acknowledged.
local acked = 0
for i = 2, #ARGV, 2 do
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  if ARGV[i + 1] ~= '' then
    redis.call('HDEL', KEYS[2], ARGV[i + 1])
  end
end
return acked
