-- Add one process's batch of grab counts to a sale's live counts, at most once.
--
-- A batch whose answer was lost (a timeout, a dropped connection) may have been
-- applied; the process sends it again, same sequence number and same counts, until it
-- hears an answer. The hash records the last sequence number applied for each process,
-- so a batch sent again after it was applied changes nothing. A process sends a sale's
-- batches one at a time, in increasing order, so "newer than the last one" is enough.
-- One such field per process that ever counted this sale: it goes with the hash, which
-- expires ARGV[3] seconds after the last batch.
--
-- KEYS[1] the sale's counts hash  ARGV[1] the process's field ('seq:<process id>')
-- ARGV[2] the batch's sequence number  ARGV[3] seconds to keep the hash
-- ARGV[4], ARGV[5], ... pairs of outcome field and count to add
-- Returns 1 when the batch was added now, 0 when it had been already.
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) <= last then
  return 0
end
for i = 4, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
