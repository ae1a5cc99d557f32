-- Part of the library in lua/seckill.lua (appended to it when loaded): the last, atomic
-- step of loading (or checking) one sale's Redis state from Postgres.
--
-- The caller holds the sale's seckill_vouchers row lock in Postgres for the whole load
-- (no worker can commit or bury an order of this sale meanwhile), has read Postgres's
-- stock and buyers under it and staged them in KEYS[3] (chunk by chunk, so a sale of
-- a few hundred thousand buyers never stalls Redis nor misses this step's deadline),
-- and has paged through the shard's stream outside any script, staging this voucher's
-- entries of users Postgres does not know in KEYS[4]. This step reads only the stream's
-- tail after the last page (bounded by ARGV[9]: a longer tail answers {-2}, and the
-- caller pages on), so it costs Redis little whatever the backlog; a rebuild swaps the
-- staged hash in with RENAME.
--
-- Orders in flight = the candidates still unacknowledged now (pending in the group,
-- or not delivered yet), one per user. Stock = Postgres's stock minus those.
--
-- KEYS[1] the sale hash (of a segmented sale: one part's)  KEYS[2] the shard's order
-- stream  KEYS[3] the staged buyers (`u:<user>` -> order: Postgres's active orders; the
-- step consumes it)  KEYS[4] the staged candidates (a list of "entry_id user_id
-- order_id", in stream order; deleted)  KEYS[5] the part's moves-out hash  KEYS[6] its
-- moves-in hash (lua/move_units.lua)  KEYS[7] the shard's term marker
-- ARGV[1] mode: 'create' (only if missing), 'heal' (if missing, or built in another
--         term, or corrupt), 'repair' (overwrite), 'check' (write nothing; compare)
-- ARGV[2] voucher_id  ARGV[3] Postgres stock  ARGV[4] begin_ms  ARGV[5] end_ms
-- ARGV[6] expire_at_ms  ARGV[7] consumer group  ARGV[8] id of the last entry paged
-- ('' when none)  ARGV[9] most tail entries read here  ARGV[10] '1': consider the
-- stream ('0' for a new sale)  ARGV[11] deadline (ms, Redis clock): later, do nothing
-- (the caller may have given up and released the lock)  ARGV[12] Postgres's buyers
-- (as staged)  ARGV[13] the epoch this build drew ('' for a check)  ARGV[14] the
-- part's epoch in Postgres now ('' when it has none)  ARGV[15] the term of the server
-- life it was built into ('' when none)  ARGV[16] m, then m pairs
-- user_id, order_id (closed orders whose release
-- to Redis is still owed; 'check' only); then the part ('' for a sale in one part: its
-- entries carry no part); then i, and i pairs move id, units (moves into the part
-- Postgres recorded and has not seen credited: counted in Postgres's stock, so marked
-- credited here); then r, and r move ids (moves out of the part Postgres recorded:
-- 'check' only)
--
-- A write drops the part's moves-out records: a move Postgres has not recorded is void
-- (Postgres's stock, from the part's allotment, still counts its units). It writes the
-- new epoch as `next_epoch`: the state admits nothing until the caller has committed
-- that epoch in Postgres and armed it (seckill_arm), so no order is ever stamped with
-- an epoch Postgres does not know. A heal that finds a state of this term written with
-- the epoch Postgres has now, but not armed (its loader died after the commit), arms
-- it instead of building it again.
--
-- Two primaries at once must not take a sale from each other in turns: a create or a
-- heal does not build a sale whose epoch Postgres recorded for a newer server life than
-- this one's (an old primary still reachable after a failover: {-4}); and a heal does
-- build again a state of this life armed with another epoch than Postgres's when that
-- epoch went to an older life (such an old primary built it meanwhile), so the newer
-- server takes its sale back.
--
-- Returns {-1} when live state was left alone, {-2} when the tail is too long, {-3}
-- past the deadline, {-4} when the sale lives on a newer server life, else
-- {expected_stock, expected_buyers, in_flight, actual_stock (-1: none), actual_buyers,
-- mismatched_buyers, owed_held, actual_epoch (0: none, or not armed), this server's
-- term, then the order id and user id of each order in flight}; 'actual' is the state
-- before this step; owed_held counts
-- owed releases whose buyer record still holds their unit ('check' only). The orders
-- in flight are the ones the new epoch carries: admitted under an earlier one, counted
-- here, so the worker writes them.
local function load_sale(keys, argv)
  local sale, stream, staged, staged_cands = keys[1], keys[2], keys[3], keys[4]
  local function done(reply)
    redis.call('DEL', staged, staged_cands)
    return reply
  end
  if clock() > tonumber(argv[11]) then
    return done({-3})
  end
  local mode = argv[1]
  local this_term = current_term(keys[7], mode ~= 'check')
  local now_fields = redis.call('HMGET', sale, unpack(SALE_FIELDS))
  local exists = now_fields[1] ~= false or redis.call('EXISTS', sale) == 1
  if mode == 'create' and exists then
    return done({-1})
  end
  local pg_epoch, pg_term = argv[14], argv[15]
  if (mode == 'create' or mode == 'heal') and pg_term ~= '' and older(this_term, pg_term) then
    return done({-4})
  end
  -- (A corrupt buyer record is rebuilt by 'repair': admission names it apart.)
  if mode == 'heal' and exists and now_fields[4] == this_term and whole(now_fields[1])
      and tonumber(now_fields[2]) and tonumber(now_fields[3]) then
    if now_fields[7] and (pg_epoch == '' or now_fields[7] == pg_epoch) then
      return done({-1})
    end
    if not now_fields[7] and pg_epoch ~= '' and now_fields[8] == pg_epoch then
      redis.call('HSET', sale, 'epoch', pg_epoch)
      redis.call('HDEL', sale, 'next_epoch')
      return done({-1})
    end
  end
  local voucher = argv[2]
  local n_pg = tonumber(argv[12])
  local owed = {}
  local n_owed = tonumber(argv[16])
  for k = 1, n_owed do
    owed[#owed + 1] = {argv[15 + 2 * k], argv[16 + 2 * k]}
  end
  local at = 17 + 2 * n_owed
  local part = argv[at] or ''
  local moved_in = {}
  for k = 1, tonumber(argv[at + 1] or '0') do
    moved_in[#moved_in + 1] = {argv[at + 2 * k], argv[at + 1 + 2 * k]}
  end
  at = at + 2 + 2 * #moved_in
  local recorded_out = {}
  for k = 1, tonumber(argv[at] or '0') do
    recorded_out[argv[at + k]] = true
  end
  local moves_out, moves_in = keys[5], keys[6]

  -- The candidates: staged, then the stream's tail after the last page.
  local cands = {}
  local n_staged = redis.call('LLEN', staged_cands)
  for from = 0, n_staged - 1, 1000 do
    for _, c in ipairs(redis.call('LRANGE', staged_cands, from, from + 999)) do
      local id, user, order = string.match(c, '^(%S+) (%S+) (%S+)$')
      cands[#cands + 1] = {id, user, order}
    end
  end
  local stream_on = argv[10] == '1' and redis.call('EXISTS', stream) == 1
  local group, last = false, '0-0'
  if stream_on then
    local start = '-'
    if argv[8] ~= '' then
      start = '(' .. argv[8]
    end
    local max = tonumber(argv[9])
    local tail = redis.call('XRANGE', stream, start, '+', 'COUNT', max + 1)
    if #tail > max then
      -- The caller pages on and comes back: keep what it staged.
      return {-2}
    end
    for _, e in ipairs(tail) do
      local f = e[2]
      local function keep(v, p, user, order)
        if v == voucher and user and order and (part == '' or p == part) then
          cands[#cands + 1] = {e[1], user, order}
        end
      end
      if f[1] == 'orders' then
        -- One admission call's orders: runs of `voucher_id` [`part`], then pairs
        -- `order_id`, `user_id` (see lua/seckill.lua).
        local v, p = nil, '0'
        for j = 5, #f - 3, 2 do
          if f[j] == 'voucher_id' then v, p = f[j + 1], '0'
          elseif f[j] == 'part' then p = f[j + 1]
          elseif f[j] == 'order_id' and f[j + 2] == 'user_id' then keep(v, p, f[j + 3], f[j + 1]) end
        end
      else
        local order, v, user, p = nil, nil, nil, '0'
        for j = 1, #f, 2 do
          if f[j] == 'order_id' then order = f[j + 1]
          elseif f[j] == 'voucher_id' then v = f[j + 1]
          elseif f[j] == 'user_id' then user = f[j + 1]
          elseif f[j] == 'part' then p = f[j + 1] end
        end
        keep(v, p, user, order)
      end
    end
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local name, lid
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1] end
        if g[j] == 'last-delivered-id' then lid = g[j + 1] end
      end
      if name == argv[7] then
        group, last = true, lid
      end
    end
  end

  -- Unacknowledged: pending in the group (the pending list is small: what workers hold
  -- right now), or after the group's last delivered entry, or no group yet.
  local pending = {}
  if group and #cands > 0 then
    for _, p in ipairs(redis.call('XPENDING', stream, argv[7], cands[1][1], cands[#cands][1], 1000000)) do
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
  if stream_on then
    for _, c in ipairs(cands) do
      local id, user, order = c[1], c[2], c[3]
      if unacked(id) then
        local pg = redis.call('HGET', staged, 'u:' .. user)
        if pg then
          if pg ~= order then
            conflicts[user] = order
          end
        elseif not in_flight[user] then
          in_flight[user] = order
          n_in = n_in + 1
        end
      end
    end
  end

  local stock = tonumber(argv[3]) - n_in
  if stock < 0 then
    stock = 0
  end

  local actual_stock, actual_buyers, mismatched = -1, 0, 0
  if exists then
    actual_stock = whole(now_fields[1]) or -1
    actual_buyers = redis.call('HLEN', sale)
    for _, v in ipairs(now_fields) do
      if v then
        actual_buyers = actual_buyers - 1
      end
    end
  end

  if mode == 'check' then
    -- A closed order whose release is still owed: while its buyer record names it, its
    -- unit is still out in Redis (the release script returns both at once).
    local owed_held = 0
    if exists then
      for _, o in ipairs(owed) do
        if redis.call('HGET', sale, 'u:' .. o[1]) == o[2] then
          owed_held = owed_held + 1
        end
      end
      stock = stock - owed_held
      -- Units on their way: taken out here and not yet recorded in Postgres (its
      -- allotment still counts them), or recorded as moved in and not yet credited.
      local out = redis.call('HGETALL', moves_out)
      for j = 1, #out, 2 do
        if not recorded_out[out[j]] then
          stock = stock - (tonumber(string.match(out[j + 1], ' (%d+)$')) or 0)
        end
      end
      for _, m in ipairs(moved_in) do
        if redis.call('HEXISTS', moves_in, m[1]) == 0 then
          stock = stock - tonumber(m[2])
        end
      end
      -- Every expected record against the live one: Postgres's (staged), then the
      -- orders in flight.
      local function compare(users, want)
        local got = redis.call('HMGET', sale, unpack(users))
        for k = 1, #got do
          if got[k] ~= want[k] then
            local u = string.sub(users[k], 3)
            if conflicts[u] and got[k] == conflicts[u] then
              stock = stock - 1
            else
              mismatched = mismatched + 1
            end
          end
        end
      end
      -- (HSCAN may return a field twice when the hash is resized meanwhile.)
      local seen = {}
      local cursor = '0'
      repeat
        local page = redis.call('HSCAN', staged, cursor, 'COUNT', 1000)
        cursor = page[1]
        local users, want = {}, {}
        for j = 1, #page[2], 2 do
          if not seen[page[2][j]] then
            seen[page[2][j]] = true
            users[#users + 1] = page[2][j]
            want[#want + 1] = page[2][j + 1]
          end
        end
        if #users > 0 then
          compare(users, want)
        end
      until cursor == '0'
      local users, want = {}, {}
      for u, o in pairs(in_flight) do
        users[#users + 1] = 'u:' .. u
        want[#want + 1] = o
        if #users == 1000 then
          compare(users, want)
          users, want = {}, {}
        end
      end
      if #users > 0 then
        compare(users, want)
      end
    end
    -- (A state whose epoch Postgres has committed is the sale's while it is being
    -- armed.)
    local epoch = now_fields[7]
    if not epoch and pg_epoch ~= '' and now_fields[8] == pg_epoch then
      epoch = now_fields[8]
    end
    return done({stock, n_pg + n_in + owed_held, n_in, actual_stock, actual_buyers, mismatched, owed_held,
      tonumber(epoch) or 0, this_term})
  end

  -- A sale never ends later than Redis already says: a close (seckill_close) that
  -- reached Redis but whose Postgres commit failed must not be undone by a reload. Sales
  -- are never extended, so the earlier end is the true one.
  local begin_ms, end_ms = tonumber(argv[4]), tonumber(argv[5])
  local closed_at = tonumber(now_fields[3])
  if closed_at and closed_at < end_ms then
    end_ms = closed_at
    begin_ms = math.min(begin_ms, end_ms - 1)
  end
  local fields = {}
  for u, o in pairs(in_flight) do
    fields[#fields + 1] = 'u:' .. u
    fields[#fields + 1] = o
    if #fields == 2000 then
      redis.call('HSET', staged, unpack(fields))
      fields = {}
    end
  end
  -- A new gen, above the old one and unlike any an earlier state of this sale had
  -- (the state may be gone, its gen with it): the clock in microseconds.
  local t = redis.call('TIME')
  local gen = math.max((tonumber(now_fields[5]) or 0) + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
  if part ~= '' then
    fields[#fields + 1] = 'part'
    fields[#fields + 1] = part
  end
  redis.call('HSET', staged, 'stock', stock, 'begin_ms', string.format('%d', begin_ms),
    'end_ms', string.format('%d', end_ms), 'term', this_term,
    'gen', string.format('%d', gen), 'next_epoch', argv[13], unpack(fields))
  -- UNLINK frees a large old state in the background.
  redis.call('UNLINK', sale)
  redis.call('RENAME', staged, sale)
  redis.call('PEXPIREAT', sale, argv[6])
  redis.call('DEL', moves_out, moves_in)
  for _, m in ipairs(moved_in) do
    redis.call('HSET', moves_in, m[1], m[2])
  end
  if #moved_in > 0 then
    redis.call('PEXPIREAT', moves_in, argv[6])
  end
  local reply = {stock, n_pg + n_in, n_in, actual_stock, actual_buyers, 0, 0, tonumber(now_fields[7]) or 0,
    this_term}
  for u, o in pairs(in_flight) do
    reply[#reply + 1] = o
    reply[#reply + 1] = u
  end
  return done(reply)
end

redis.register_function('seckill_load', load_sale)
