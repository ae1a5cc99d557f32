-- Load (or rebuild) one sale's Redis state from Postgres.
--
-- KEYS[1] the sale hash  KEYS[2] the shard's order stream
-- ARGV[1] mode: 'create' (a new sale: load if missing; nothing can be in flight yet),
--         'load' (load if missing, counting orders in flight), 'repair' (overwrite)
-- ARGV[2] voucher_id  ARGV[3] Postgres remaining stock  ARGV[4] begin_ms  ARGV[5] end_ms
-- ARGV[6] expire_at_ms  ARGV[7] the consumer group
-- ARGV[8..] pairs user_id, order_id of the orders Postgres holds
--
-- Buyers become Postgres's buyers plus the orders in flight: this voucher's stream
-- entries not yet acknowledged (pending, or not delivered yet) whose user Postgres does
-- not know. Stock becomes Postgres's stock minus those in-flight orders. Buyers whose
-- orders were dead-lettered are dropped: they hold no order.
-- Returns {-1} when live state was left alone, else {stock, buyers, in_flight}.
local mode = ARGV[1]
if mode ~= 'repair' and redis.call('EXISTS', KEYS[1]) == 1 then
  return {-1}
end

local fields = {}
local in_pg = {}
for i = 8, #ARGV, 2 do
  in_pg[ARGV[i]] = true
  fields[#fields + 1] = 'u:' .. ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
end

-- O(stream length): the stream only holds what the workers have not acknowledged and
-- trimmed yet. Loading and repair are rare; admission never does this.
local function id_parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function after(a, b)
  local ams, aseq = id_parts(a)
  local bms, bseq = id_parts(b)
  return ams > bms or (ams == bms and aseq > bseq)
end

local in_flight = 0
if mode ~= 'create' and redis.call('EXISTS', KEYS[2]) == 1 then
  -- Unacknowledged = pending in the group, or after its last delivered entry.
  local last_delivered = '0-0'
  local unacked = {}
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[2])) do
    local name, last
    for i = 1, #group, 2 do
      if group[i] == 'name' then name = group[i + 1] end
      if group[i] == 'last-delivered-id' then last = group[i + 1] end
    end
    if name == ARGV[7] then
      last_delivered = last
      for _, p in ipairs(redis.call('XPENDING', KEYS[2], ARGV[7], '-', '+', 1000000000)) do
        unacked[p[1]] = true
      end
    end
  end
  local voucher = ARGV[2]
  for _, entry in ipairs(redis.call('XRANGE', KEYS[2], '-', '+')) do
    if unacked[entry[1]] or after(entry[1], last_delivered) then
      local f = entry[2]
      local order, v, user
      for i = 1, #f, 2 do
        if f[i] == 'order_id' then order = f[i + 1]
        elseif f[i] == 'voucher_id' then v = f[i + 1]
        elseif f[i] == 'user_id' then user = f[i + 1] end
      end
      if v == voucher and user and order and not in_pg[user] then
        in_pg[user] = true
        fields[#fields + 1] = 'u:' .. user
        fields[#fields + 1] = order
        in_flight = in_flight + 1
      end
    end
  end
end

local stock = tonumber(ARGV[3]) - in_flight
if stock < 0 then
  stock = 0
end

redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'stock', stock, 'begin_ms', ARGV[4], 'end_ms', ARGV[5])
for i = 1, #fields, 1000 do
  redis.call('HSET', KEYS[1], unpack(fields, i, math.min(i + 999, #fields)))
end
redis.call('PEXPIREAT', KEYS[1], ARGV[6])
return {stock, #fields / 2, in_flight}
