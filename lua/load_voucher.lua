-- Part of the library in lua/seckill.lua (appended to it when loaded): the last, atomic
-- step of loading one sale's Redis state from Postgres (seckill_load), and its read-only
-- twin, which compares the state with what a load would write (seckill_check, for
-- `seckill reconcile`).
--
-- The caller holds the sale's seckill_vouchers row lock in Postgres for the whole step
-- (no worker can commit or bury an order of this sale meanwhile), has read Postgres's
-- stock and buyers under it and staged them in KEYS[3] (chunk by chunk, so a sale of
-- a few hundred thousand buyers never stalls Redis nor misses this step's deadline),
-- and has paged through the shard's stream outside any script, staging this voucher's
-- entries of users Postgres does not know in KEYS[4]. This step reads only the stream's
-- tail after the last page (bounded by `page`: a longer tail answers {-2}, and the
-- caller pages on), so it costs Redis little whatever the backlog; a rebuild swaps the
-- staged hash in with RENAME.
--
-- Orders in flight = the candidates still unacknowledged now (pending in the group,
-- or not delivered yet), one per user. Stock = Postgres's stock minus those.
--
-- KEYS[1] the sale hash (of a segmented sale: one part's)  KEYS[2] the shard's order
-- stream  KEYS[3] the staged buyers (`u:<user>` -> order: Postgres's active orders)
-- KEYS[4] the staged candidates (a list of "entry_id user_id order_id", in stream
-- order)  KEYS[5] the part's moves-out hash  KEYS[6] its moves-in hash
-- (lua/move_units.lua)  KEYS[7] the shard's term marker
-- ARGV[1] one JSON object. Ids are strings (an order id does not fit a Lua number);
-- counts and times (ms, Redis's clock) are numbers; a field that does not apply is
-- absent. Both functions read:
--   voucher, part      the voucher id; the part's label (absent for a sale in one part:
--                      its entries carry none)
--   pg_stock           Postgres's stock (of a part: its allotment less its buyers')
--   pg_buyers          Postgres's buyers, as staged
--   pg_epoch           the part's epoch in Postgres now (absent: none)
--   moved_in           [{id, units}]: moves into the part Postgres recorded and has
--                      not seen credited (counted in Postgres's stock)
--   group, after, page the consumer group; the id of the last entry paged (absent:
--                      none); the most tail entries read here
--   scan               whether the stream counts (false for a new sale)
--   deadline_ms        later than this, do nothing (the caller may have given up and
--                      released the lock)
-- seckill_load also reads:
--   mode               'create' (only if missing), 'heal' (if missing, or built in
--                      another term, or corrupt), 'repair' (overwrite), 'drawn' (a
--                      segmented lottery's part after its draw: only a state of this
--                      term still holding its window, armed with Postgres's epoch)
--   epoch              the epoch this build drew
--   pg_term            the term of the server life Postgres's epoch was built into
--   begin_ms, end_ms, expire_at_ms
--   draw_recorded      whether Postgres records the sale's draw (a lottery)
-- seckill_check also reads:
--   owed               [{user, order}]: closed orders whose release to Redis is owed
--   recorded_out       [move id]: moves out of the part Postgres recorded
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
-- Both return {-2} when the tail is too long (the staged keys kept), {-3} past the
-- deadline. seckill_load consumes the staged keys and returns {-1} when live state was
-- left alone, {-4} when the sale lives on a newer server life, else {stock, buyers,
-- in_flight, this server's term, then the order id and user id of each order in
-- flight}: the orders the new epoch carries (admitted under an earlier one, counted
-- here, so the worker writes them). seckill_check leaves the staged keys to its caller
-- and returns {expected_stock, expected_buyers, in_flight, actual_stock (-1: none),
-- actual_buyers, mismatched_buyers, owed_held, actual_epoch (0: none, or not armed)}:
-- owed_held counts owed releases whose buyer record still holds their unit (counted in
-- the expected figures).

-- The keys both functions take, by name.
local function fence_keys(keys)
  return {sale = keys[1], stream = keys[2], staged = keys[3], cands = keys[4],
    moves_out = keys[5], moves_in = keys[6], marker = keys[7]}
end

-- The step's argument. A caller of an earlier release passes positional arguments:
-- refused before anything is read or written.
local function step_args(argv)
  local ok, a = pcall(cjson.decode, argv[1] or '')
  if not ok or type(a) ~= 'table' then
    error('the load step takes one JSON argument (is the caller of an earlier release?)')
  end
  return a
end

-- The sale's fields (SALE_FIELDS), and whether the sale's state exists at all.
local function sale_now(sale)
  local now = redis.call('HMGET', sale, unpack(SALE_FIELDS))
  return now, now[1] ~= false or redis.call('EXISTS', sale) == 1
end

-- Appends the sale's orders in stream entry `e` to `cands`.
local function entry_orders(e, a, cands)
  local f = e[2]
  local function keep(v, p, user, order)
    if v == a.voucher and user and order and (a.part == nil or p == a.part) then
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

-- The candidates, in stream order ({entry id, user id, order id}): those staged, then
-- the sale's entries in the stream's tail after the last page; and whether the stream
-- counts. nil when the tail is longer than the step reads.
local function candidates(k, a)
  local cands = {}
  local n_staged = redis.call('LLEN', k.cands)
  for from = 0, n_staged - 1, 1000 do
    for _, c in ipairs(redis.call('LRANGE', k.cands, from, from + 999)) do
      local id, user, order = string.match(c, '^(%S+) (%S+) (%S+)$')
      cands[#cands + 1] = {id, user, order}
    end
  end
  if not (a.scan and redis.call('EXISTS', k.stream) == 1) then
    return cands, false
  end
  local start = a.after and ('(' .. a.after) or '-'
  local tail = redis.call('XRANGE', k.stream, start, '+', 'COUNT', a.page + 1)
  if #tail > a.page then
    return nil
  end
  for _, e in ipairs(tail) do
    entry_orders(e, a, cands)
  end
  return cands, true
end

-- Whether an entry is still unacknowledged: pending in the group (the pending list is
-- small: what workers hold right now), or after the group's last delivered entry, or
-- no group yet.
local function unacked_test(stream, group_name, cands)
  local group, last = false, '0-0'
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local name, lid
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] end
      if g[j] == 'last-delivered-id' then lid = g[j + 1] end
    end
    if name == group_name then
      group, last = true, lid
    end
  end
  local pending = {}
  if group and #cands > 0 then
    for _, p in ipairs(redis.call('XPENDING', stream, group_name, cands[1][1], cands[#cands][1], 1000000)) do
      pending[p[1]] = true
    end
  end
  local function id_parts(id)
    local ms, seq = string.match(id, '^(%d+)-(%d+)$')
    return tonumber(ms), tonumber(seq)
  end
  local lms, lseq = id_parts(last)
  return function(id)
    if not group or pending[id] then
      return true
    end
    local ms, seq = id_parts(id)
    return ms > lms or (ms == lms and seq > lseq)
  end
end

-- What a load would write now: {stock, n_in, in_flight (user -> order), conflicts}, or
-- nil when the tail is too long. An unacknowledged order of a user Postgres knows under
-- another id will be buried; until then the user's record may still name it, with its
-- unit out (conflicts: user -> that order).
local function expected(k, a)
  local cands, stream_on = candidates(k, a)
  if not cands then
    return nil
  end
  local in_flight, n_in, conflicts = {}, 0, {}
  local unacked = stream_on and unacked_test(k.stream, a.group, cands)
  for _, c in ipairs(cands) do
    local id, user, order = c[1], c[2], c[3]
    if unacked and unacked(id) then
      local pg = redis.call('HGET', k.staged, 'u:' .. user)
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
  return {stock = math.max(a.pg_stock - n_in, 0), n_in = n_in, in_flight = in_flight,
    conflicts = conflicts}
end

-- Whether a load leaves the state as it is: -1 (there, for a create; there, of this
-- term, sound and armed with Postgres's epoch, for a heal, which arms a state written
-- with Postgres's epoch whose loader died after the commit; for a drawn part, anything
-- but a state of this term holding its window, armed with Postgres's epoch: an old
-- primary's copy is not the sale's, and one rebuilt already stays), -4 (the sale lives
-- on a newer server life), or nil: build it.
local function left_alone(k, a, now, exists, this_term)
  if a.mode == 'create' and exists then
    return -1
  end
  if a.mode ~= 'repair' and a.pg_term and older(this_term, a.pg_term) then
    return -4
  end
  if a.mode == 'drawn' and (not exists or now[4] ~= this_term or not now[9]
      or not now[7] or now[7] ~= a.pg_epoch) then
    return -1
  end
  -- (A corrupt buyer record is rebuilt by 'repair': admission names it apart.)
  if a.mode ~= 'heal' or not exists or now[4] ~= this_term or not whole(now[1])
      or not tonumber(now[2]) or not tonumber(now[3]) then
    return nil
  end
  if now[7] and (a.pg_epoch == nil or now[7] == a.pg_epoch) then
    return -1
  end
  if not now[7] and a.pg_epoch and now[8] == a.pg_epoch then
    redis.call('HSET', k.sale, 'epoch', a.pg_epoch)
    redis.call('HDEL', k.sale, 'next_epoch')
    return -1
  end
  return nil
end

-- A lottery sale's fields for the state being built (appended to `fields`). A draw the
-- old state records is carried over and never armed again, marked `unrecorded` unless
-- Postgres records it (whatever the old state said: it may be of a release that did not
-- mark). A lottery is armed (its window's end and seed) only while the sale has no order
-- anywhere (Postgres or in flight): nothing is admitted before the draw, so an order
-- means it was drawn. The old state's entrants stay entrants (a rebuild mid-window does
-- not drop them).
local function lottery_fields(k, a, now, exp, fields)
  if now[11] then
    for i, f in ipairs(DRAW_FIELDS) do
      if f ~= 'unrecorded' and now[9 + i] then
        fields[#fields + 1] = f
        fields[#fields + 1] = now[9 + i]
      end
    end
    if not a.draw_recorded then
      fields[#fields + 1] = 'unrecorded'
      fields[#fields + 1] = '1'
    end
    return
  end
  if not a.lottery_end_ms or a.pg_buyers + exp.n_in > 0 then
    return
  end
  fields[#fields + 1] = 'lottery_end'
  fields[#fields + 1] = string.format('%d', a.lottery_end_ms)
  fields[#fields + 1] = 'lottery_seed'
  fields[#fields + 1] = a.lottery_seed
  local all, marks = redis.call('HGETALL', k.sale), {}
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 2) == 'u:' and entrant_like(all[i + 1]) then
      marks[#marks + 1] = all[i]
      marks[#marks + 1] = all[i + 1]
    end
  end
  in_chunks('HSET', k.staged, marks)
end

-- Builds the state in the staged hash (Postgres's buyers) with the orders in flight,
-- swaps it in, and marks the moves into the part credited.
local function write_state(k, a, now, exp, this_term)
  -- A sale never ends later than Redis already says: a close (seckill_close) that
  -- reached Redis but whose Postgres commit failed must not be undone by a reload. Sales
  -- are never extended, so the earlier end is the true one.
  local begin_ms, end_ms = a.begin_ms, a.end_ms
  local closed_at = tonumber(now[3])
  if closed_at and closed_at < end_ms then
    end_ms = closed_at
    begin_ms = math.min(begin_ms, end_ms - 1)
  end
  local fields = {}
  for u, o in pairs(exp.in_flight) do
    fields[#fields + 1] = 'u:' .. u
    fields[#fields + 1] = o
    if #fields == 2000 then
      redis.call('HSET', k.staged, unpack(fields))
      fields = {}
    end
  end
  -- A new gen, above the old one and unlike any an earlier state of this sale had
  -- (the state may be gone, its gen with it): the clock in microseconds.
  local t = redis.call('TIME')
  local gen = math.max((tonumber(now[5]) or 0) + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
  if a.part then
    fields[#fields + 1] = 'part'
    fields[#fields + 1] = a.part
  end
  lottery_fields(k, a, now, exp, fields)
  redis.call('HSET', k.staged, 'stock', exp.stock, 'begin_ms', string.format('%d', begin_ms),
    'end_ms', string.format('%d', end_ms), 'term', this_term,
    'gen', string.format('%d', gen), 'next_epoch', a.epoch, unpack(fields))
  -- UNLINK frees a large old state in the background.
  redis.call('UNLINK', k.sale)
  redis.call('RENAME', k.staged, k.sale)
  local expire_at = string.format('%d', a.expire_at_ms)
  redis.call('PEXPIREAT', k.sale, expire_at)
  redis.call('DEL', k.moves_out, k.moves_in)
  for _, m in ipairs(a.moved_in) do
    redis.call('HSET', k.moves_in, m.id, string.format('%d', m.units))
  end
  if #a.moved_in > 0 then
    redis.call('PEXPIREAT', k.moves_in, expire_at)
  end
end

local function load_sale(keys, argv)
  local k, a = fence_keys(keys), step_args(argv)
  local function done(reply)
    redis.call('DEL', k.staged, k.cands)
    return reply
  end
  if clock() > a.deadline_ms then
    return done({-3})
  end
  local this_term = current_term(k.marker, true)
  local now, exists = sale_now(k.sale)
  local code = left_alone(k, a, now, exists, this_term)
  if code then
    return done({code})
  end
  local exp = expected(k, a)
  if not exp then
    -- The caller pages on and comes back: keep what it staged.
    return {-2}
  end
  write_state(k, a, now, exp, this_term)
  local reply = {exp.stock, a.pg_buyers + exp.n_in, exp.n_in, this_term}
  for u, o in pairs(exp.in_flight) do
    reply[#reply + 1] = o
    reply[#reply + 1] = u
  end
  return done(reply)
end

-- Every expected buyer record against the live one: Postgres's (staged), then the
-- orders in flight. Returns how many records are missing or name another order, and
-- how many units are out with a conflict's record (see `expected`).
local function compare_records(k, exp)
  local mismatched, conflicting = 0, 0
  local function compare(users, want)
    local got = redis.call('HMGET', k.sale, unpack(users))
    for j = 1, #got do
      if got[j] ~= want[j] then
        local u = string.sub(users[j], 3)
        if exp.conflicts[u] and got[j] == exp.conflicts[u] then
          conflicting = conflicting + 1
        else
          mismatched = mismatched + 1
        end
      end
    end
  end
  -- (HSCAN may return a field twice when the hash is resized meanwhile.)
  local seen, cursor = {}, '0'
  repeat
    local page = redis.call('HSCAN', k.staged, cursor, 'COUNT', 1000)
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
  for u, o in pairs(exp.in_flight) do
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
  return mismatched, conflicting
end

-- Units on their way: taken out of the part and not yet recorded in Postgres (its
-- allotment still counts them), or recorded as moved in and not yet credited.
local function units_on_their_way(k, a)
  local recorded, units = {}, 0
  for _, id in ipairs(a.recorded_out) do
    recorded[id] = true
  end
  local out = redis.call('HGETALL', k.moves_out)
  for j = 1, #out, 2 do
    if not recorded[out[j]] then
      units = units + (tonumber(string.match(out[j + 1], ' (%d+)$')) or 0)
    end
  end
  for _, m in ipairs(a.moved_in) do
    if redis.call('HEXISTS', k.moves_in, m.id) == 0 then
      units = units + m.units
    end
  end
  return units
end

-- A closed order whose release is still owed: while its buyer record names it, its
-- unit is still out in Redis (the release script returns both at once).
local function owed_held(sale, owed)
  local held = 0
  for _, o in ipairs(owed) do
    if redis.call('HGET', sale, 'u:' .. o.user) == o.order then
      held = held + 1
    end
  end
  return held
end

local function check_sale(keys, argv)
  local k, a = fence_keys(keys), step_args(argv)
  if clock() > a.deadline_ms then
    return {-3}
  end
  -- (A look at the marker, as every function takes: another life's data draws a term.)
  current_term(k.marker, false)
  local now, exists = sale_now(k.sale)
  local exp = expected(k, a)
  if not exp then
    return {-2}
  end
  local stock, actual_stock, actual_buyers, mismatched, held = exp.stock, -1, 0, 0, 0
  if exists then
    actual_stock = whole(now[1]) or -1
    actual_buyers = redis.call('HLEN', k.sale)
    for _, v in ipairs(now) do
      if v then
        actual_buyers = actual_buyers - 1
      end
    end
    -- A lottery not drawn yet (`lottery_end`) has admitted nobody: its buyer records
    -- are its entrants' marks.
    if now[9] then
      actual_buyers = 0
    end
    held = owed_held(k.sale, a.owed)
    local conflicting
    mismatched, conflicting = compare_records(k, exp)
    stock = stock - held - conflicting - units_on_their_way(k, a)
  end
  -- (A state whose epoch Postgres has committed is the sale's while it is being
  -- armed.)
  local epoch = now[7]
  if not epoch and a.pg_epoch and now[8] == a.pg_epoch then
    epoch = now[8]
  end
  return {stock, a.pg_buyers + exp.n_in + held, exp.n_in, actual_stock, actual_buyers, mismatched, held,
    tonumber(epoch) or 0}
end

redis.register_function('seckill_load', load_sale)
redis.register_function{function_name = 'seckill_check', callback = check_sale, flags = {'no-writes'}}
