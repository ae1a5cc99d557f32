-- The live view's read of one sale's counts hash (see `lua/add_live_counts.lua`): the
-- running totals asked for, and the recent values summed over the cells of the
-- ARGV[3] whole seconds before the current one, by this server's clock (the one the
-- cells were written by). Read only.
--
-- KEYS[1] the sale's counts hash  ARGV[1] cells in the ring  ARGV[2] values in a cell
-- ARGV[3] seconds summed  ARGV[4] .. the total fields
-- Returns {{total or false, ...}, {sum of each recent value}}.
local now = tonumber(redis.call('TIME')[1])
local ring, values, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local totals = redis.call('HMGET', KEYS[1], unpack(ARGV, 4))
local sums, names = {}, {}
for j = 1, values do
  sums[j] = 0
end
for second = now - window, now - 1 do
  local cell = 'r' .. (second % ring) .. ':'
  if tonumber(redis.call('HGET', KEYS[1], cell .. 't')) == second then
    for j = 1, values do
      names[j] = cell .. (j - 1)
    end
    local held = redis.call('HMGET', KEYS[1], unpack(names))
    for j = 1, values do
      sums[j] = sums[j] + (tonumber(held[j]) or 0)
    end
  end
end
return {totals, sums}
