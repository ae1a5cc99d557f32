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
-- Besides the running totals, the batch's grabs and errors are added to the cell of
-- the current second, by this server's clock, of a ring of ARGV[4] cells: cell c is the
-- fields 'r<c>:t' (its second), 'r<c>:0' (grabs) and 'r<c>:1' (errors). A cell last
-- written in another second starts again from zero. The live view sums the cells of
-- the last few seconds (`lua/read_live_counts.lua`), so a page opening mid-sale sees the
-- current rates at once, the same on every instance. Every field holds an integer.
--
-- KEYS[1] the sale's counts hash  ARGV[1] the process's field ('seq:<process id>')
-- ARGV[2] the batch's sequence number  ARGV[3] seconds to keep the hash
-- ARGV[4] cells in the ring  ARGV[5] the batch's grabs  ARGV[6] its errors
-- ARGV[7] .. pairs of total field and count to add
-- Returns 1 when the batch was added now, 0 when it had been already.
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) <= last then
  return 0
end
for i = 7, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
if tonumber(ARGV[5]) > 0 then
  local now = tonumber(redis.call('TIME')[1])
  local cell = 'r' .. (now % tonumber(ARGV[4])) .. ':'
  if tonumber(redis.call('HGET', KEYS[1], cell .. 't')) ~= now then
    redis.call('HSET', KEYS[1], cell .. 't', now, cell .. '0', 0, cell .. '1', 0)
  end
  redis.call('HINCRBY', KEYS[1], cell .. '0', ARGV[5])
  redis.call('HINCRBY', KEYS[1], cell .. '1', ARGV[6])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
