-- The last, atomic step of loading (or checking) one sale's Redis state from Postgres.
--
-- The caller holds the sale's seckill_vouchers row lock in Postgres for the whole load
-- (no worker can commit or bury an order of this sale meanwhile), has read Postgres's
-- stock and buyers under it, and has paged through the shard's stream outside any
-- script, collecting this voucher's entries of users Postgres does not know. This step
-- reads only the stream's tail after the last page (bounded by ARGV[9]: a longer tail
-- answers {-2}, and the caller pages on), so it costs Redis a few milliseconds
-- whatever the backlog.
--
-- Orders in flight = the candidates still unacknowledged now (pending in the group,
-- or not delivered yet), one per user. Stock = Postgres's stock minus those.
--
-- The layout (buyer prefix, entry fields) is the one src/keys.rs defines; a unit test
-- there keeps this script in step.
--
-- KEYS[1] the sale hash  KEYS[2] the shard's order stream
-- ARGV[1] mode: 'create' / 'load' (only if missing), 'repair' (overwrite), 'check'
--         (write nothing; compare)
-- ARGV[2] voucher_id  ARGV[3] Postgres stock  ARGV[4] begin_ms  ARGV[5] end_ms
-- ARGV[6] expire_at_ms  ARGV[7] consumer group  ARGV[8] id of the last entry paged
-- ('' when none)  ARGV[9] most tail entries read here  ARGV[10] '1': consider the
-- stream ('0' for a new sale)  ARGV[11] deadline (ms, Redis clock): later, do nothing
-- (the caller may have given up and released the lock)  ARGV[12] n, then n pairs
-- user_id, order_id (Postgres's buyers: its active orders), then m, then m pairs
-- user_id, order_id (closed orders whose release to Redis is still owed; 'check' only),
-- then triples entry_id, user_id, order_id (the paged candidates, in order)
--
-- Returns {-1} when live state was left alone, {-2} when the tail is too long, {-3}
-- past the deadline, else
-- {expected_stock, expected_buyers, in_flight, actual_stock (-1: none), actual_buyers,
-- mismatched_buyers, owed_held}; 'actual' is the state before this step; owed_held
-- counts owed releases whose buyer record still holds their unit ('check' only).
local t = redis.call('TIME')
if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(ARGV[11]) then
  return {-3}
end
local mode = ARGV[1]
local exists = redis.call('EXISTS', KEYS[1]) == 1
if (mode == 'create' or mode == 'load') and exists then
  return {-1}
end
local voucher = ARGV[2]

local pg = {}
local n_pg = tonumber(ARGV[12])
local i = 13
for _ = 1, n_pg do
  pg[ARGV[i]] = ARGV[i + 1]
  i = i + 2
end
local owed = {}
local n_owed = tonumber(ARGV[i])
i = i + 1
for _ = 1, n_owed do
  owed[#owed + 1] = {ARGV[i], ARGV[i + 1]}
  i = i + 2
end
local cands = {}
while i + 2 <= #ARGV do
  cands[#cands + 1] = {ARGV[i], ARGV[i + 1], ARGV[i + 2]}
  i = i + 3
end

local stream = ARGV[10] == '1' and redis.call('EXISTS', KEYS[2]) == 1
local group, last = false, '0-0'
if stream then
  local start = '-'
  if ARGV[8] ~= '' then
    start = '(' .. ARGV[8]
  end
  local max = tonumber(ARGV[9])
  local tail = redis.call('XRANGE', KEYS[2], start, '+', 'COUNT', max + 1)
  if #tail > max then
    return {-2}
  end
  for _, e in ipairs(tail) do
    local f = e[2]
    local order, v, user
    for j = 1, #f, 2 do
      if f[j] == 'order_id' then order = f[j + 1]
      elseif f[j] == 'voucher_id' then v = f[j + 1]
      elseif f[j] == 'user_id' then user = f[j + 1] end
    end
    if v == voucher and user and order then
      cands[#cands + 1] = {e[1], user, order}
    end
  end
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[2])) do
    local name, lid
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] end
      if g[j] == 'last-delivered-id' then lid = g[j + 1] end
    end
    if name == ARGV[7] then
      group, last = true, lid
    end
  end
end

-- Unacknowledged: pending in the group (the pending list is small: what workers hold
-- right now), or after the group's last delivered entry, or no group yet.
local pending = {}
if group and #cands > 0 then
  for _, p in ipairs(redis.call('XPENDING', KEYS[2], ARGV[7], cands[1][1], cands[#cands][1], 1000000)) do
    pending[p[1]] = true
  end
end
local function id_parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local lms, lseq = id_parts(last)
local function unacked(id)
  if not group or pending[id] then
    return true
  end
  local ms, seq = id_parts(id)
  return ms > lms or (ms == lms and seq > lseq)
end

local in_flight, n_in = {}, 0
-- An unacknowledged order of a user Postgres knows under another id will be buried;
-- until then the user's record may still name it, with its unit out.
local conflicts = {}
if stream then
  for _, c in ipairs(cands) do
    local id, user, order = c[1], c[2], c[3]
    if unacked(id) then
      if pg[user] then
        if pg[user] ~= order then
          conflicts[user] = order
        end
      elseif not in_flight[user] then
        in_flight[user] = order
        n_in = n_in + 1
      end
    end
  end
end

local stock = tonumber(ARGV[3]) - n_in
if stock < 0 then
  stock = 0
end

local actual_stock, actual_buyers, mismatched = -1, 0, 0
if exists then
  actual_stock = tonumber(redis.call('HGET', KEYS[1], 'stock') or '-1') or -1
  actual_buyers = redis.call('HLEN', KEYS[1]) - 3
end

if mode == 'check' then
  -- A closed order whose release is still owed: while its buyer record names it, its
  -- unit is still out in Redis (the release script returns both at once).
  local owed_held = 0
  if exists then
    for _, o in ipairs(owed) do
      if redis.call('HGET', KEYS[1], 'u:' .. o[1]) == o[2] then
        owed_held = owed_held + 1
      end
    end
    stock = stock - owed_held
  end
  if exists then
    local users, want = {}, {}
    for u, o in pairs(pg) do
      users[#users + 1] = u
      want[#want + 1] = o
    end
    for u, o in pairs(in_flight) do
      users[#users + 1] = u
      want[#want + 1] = o
    end
    for from = 1, #users, 1000 do
      local fields = {}
      for k = from, math.min(from + 999, #users) do
        fields[#fields + 1] = 'u:' .. users[k]
      end
      local got = redis.call('HMGET', KEYS[1], unpack(fields))
      for k = 1, #got do
        local u = users[from + k - 1]
        if got[k] ~= want[from + k - 1] then
          if conflicts[u] and got[k] == conflicts[u] then
            stock = stock - 1
          else
            mismatched = mismatched + 1
          end
        end
      end
    end
  end
  return {stock, n_pg + n_in + owed_held, n_in, actual_stock, actual_buyers, mismatched, owed_held}
end

local fields = {}
for u, o in pairs(pg) do
  fields[#fields + 1] = 'u:' .. u
  fields[#fields + 1] = o
end
for u, o in pairs(in_flight) do
  fields[#fields + 1] = 'u:' .. u
  fields[#fields + 1] = o
end
-- A sale never ends later than Redis already says: a close (lua/close_sale.lua) that
-- reached Redis but whose Postgres commit failed must not be undone by a reload. Sales
-- are never extended, so the earlier end is the true one.
local begin_ms, end_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local closed_at = tonumber(redis.call('HGET', KEYS[1], 'end_ms'))
if closed_at and closed_at < end_ms then
  end_ms = closed_at
  begin_ms = math.min(begin_ms, end_ms - 1)
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'stock', stock, 'begin_ms', string.format('%d', begin_ms),
  'end_ms', string.format('%d', end_ms))
for k = 1, #fields, 1000 do
  redis.call('HSET', KEYS[1], unpack(fields, k, math.min(k + 999, #fields)))
end
redis.call('PEXPIREAT', KEYS[1], ARGV[6])
return {stock, n_pg + n_in, n_in, actual_stock, actual_buyers, 0, 0}
