-- The live view's read of one sale's counts hash (see `lua/add_live_counts.lua`): the
-- running totals asked for, and the grabs and errors summed over the cells of the
-- ARGV[2] whole seconds before the current one, by this server's clock (the one the
-- cells were written by). Read only.
--
-- KEYS[1] the sale's counts hash  ARGV[1] cells in the ring  ARGV[2] seconds summed
-- ARGV[3] .. the total fields
-- Returns {{total or false, ...}, {grabs, errors}}.
local now = tonumber(redis.call('TIME')[1])
local ring, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local totals = redis.call('HMGET', KEYS[1], unpack(ARGV, 3))
local grabs, errors = 0, 0
for second = now - window, now - 1 do
  local cell = 'r' .. (second % ring) .. ':'
  local held = redis.call('HMGET', KEYS[1], cell .. 't', cell .. '0', cell .. '1')
  if tonumber(held[1]) == second then
    grabs = grabs + (tonumber(held[2]) or 0)
    errors = errors + (tonumber(held[3]) or 0)
  end
end
return {totals, {grabs, errors}}
