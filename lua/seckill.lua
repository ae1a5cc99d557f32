#!lua name=seckill
-- The service's Redis function library: admission, the term, order-id leases, and,
-- appended to this file when the library is loaded, loading a sale's state
-- (lua/load_voucher.lua), moving units between the parts of a sale (lua/move_units.lua)
-- and what follows admission (lua/lifecycle.lua: releases, settles, closes). A library
-- rather than plain scripts for one reason: its local variables live as long as the
-- server's Lua engine does, so it can tell a state written in THIS life of the server
-- from one that came back from a snapshot, an append-only file or a replica (Redis
-- acknowledges writes before they are on disk or on a replica, so a restart or a
-- failover can hand us an older Redis). Every function that writes looks at its slot's
-- term marker first (current_term), so a server that was a replica in between also
-- knows.
--
-- The layout (buyer prefix, entry fields) is the one src/keys.rs defines; a unit test
-- there keeps this file in step.

-- Raised with every change of this library (a unit test in src/scripts.rs holds it to
-- the code): a process replaces a loaded library only if it is older, or of the same
-- version with other code, so two releases never take turns replacing each other.
local VERSION = 13
-- A hash of this code, filled in when it is loaded.
local CODE = '__CODE__'

-- The term: a token drawn at the first call of this server's life (after a start, a
-- promotion from replica, a (re)load of this library), when a process saw the server's
-- identity change, or when the server's data shows another life wrote it (see
-- current_term). Every sale's state carries the term it was built in; admission
-- refuses a state of another term (code 6), and the state is rebuilt from Postgres.
local term, term_ms
-- The terms this life drew, and the other lives' terms it has answered with a draw.
local known = {}
-- Per term marker (one key space's slot), the term whose sales may admit: a new term
-- holds every grab (code 9) until every API instance has admitted again the 202s an
-- earlier life may have lost (src/admission/keepers.rs), so that no shopper wins a
-- second time before their first 202 is back (seckill_open_term).
local opened = {}
-- The terms of the other lives whose data this life found (a failover's old primary,
-- the life a snapshot was taken in), in any slot: the instances that were on them are
-- those whose 202s this life may have lost.
local came_after, ncame_after = {}, 0

-- What this life wrote that may not vanish before its time: per key (a term marker, an
-- order stream, an order-id lease), until when (ms, this server's clock) it must exist.
-- A key of ours gone sooner (evicted, flushed, deleted by hand) means writes of this
-- life are lost, as surely as after a restart from an older copy (see lose).
local kept = {}
local FOREVER = 2 ^ 53
-- (Redis expires a key by the time a script started: a key may go a little early.)
local KEPT_SLACK_MS = 50

-- This server's memory, looked at every MEMORY_EVERY_MS at most (INFO, in the call that
-- asks for the term): `evicts` while its maxmemory-policy may evict keys (any but
-- noeviction: every key of ours is state a promise rests on), and its evicted_keys
-- count, whose growth means some key of ours may be gone. A server that does not let
-- a script read INFO (renamed) is taken for one that does not evict.
local MEMORY_EVERY_MS = 100
local memory = {at = nil, evicts = false, evicted = nil}

local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), t
end

-- Whether keys were evicted since the last look at the memory (once due).
local function evicted_since(now)
  if memory.at and now >= memory.at and now < memory.at + MEMORY_EVERY_MS then
    return false
  end
  memory.at = now
  local ok, info = pcall(redis.call, 'INFO', 'memory')
  if ok then
    local policy = string.match(info, 'maxmemory_policy:(%S+)')
    memory.evicts = policy ~= nil and policy ~= 'noeviction'
  end
  local ok_stats, stats = pcall(redis.call, 'INFO', 'stats')
  local n = ok_stats and tonumber(string.match(stats, 'evicted_keys:(%d+)'))
  local grew = n and memory.evicted and n > memory.evicted
  if n then
    memory.evicted = n
  end
  return grew or false
end

-- Whether `key`, which this life wrote and which should still exist, is gone; `here`:
-- whether it exists (read by the caller).
local function vanished(key, here, now)
  local until_ms = kept[key]
  return not here and until_ms ~= nil and now < until_ms - KEPT_SLACK_MS
end

local function draw()
  local ms, t = clock()
  -- Two servers drawing in the same microsecond still differ by their Lua heap.
  term = t[1] .. '.' .. t[2] .. '.' .. (string.match(tostring({}), '0x(%x+)') or '0')
  term_ms = ms
  known[term] = true
end

-- Whether term `a` was drawn before term `b` (a term begins with the server's clock, in
-- seconds and microseconds, when it was drawn: a replica promoted by a failover draws
-- its term after the old primary drew its own).
local function older(a, b)
  local as, au = string.match(a, '^(%d+)%.(%d+)')
  local bs, bu = string.match(b, '^(%d+)%.(%d+)')
  if not as or not bs then
    return false
  end
  as, au, bs, bu = tonumber(as), tonumber(au), tonumber(bs), tonumber(bu)
  return as < bs or (as == bs and au < bu)
end

-- Writes this life made are gone: a new term, as after a restart from an older copy
-- (every sale's state stale until rebuilt, a lease claimed now waits out the grace),
-- and the old term is among the lives whose 202s this one may have lost: the
-- instances on it admit theirs again before the new term opens. What this life kept
-- is forgotten: the new term answers for all of it.
local function lose()
  ncame_after = ncame_after + 1
  came_after[ncame_after] = term
  kept = {}
  draw()
end

-- The server's term, after a look at `marker` (a key of the call's slot, when given):
-- it names the term of the life that last wrote that slot's data. A term this life
-- never saw means the data came from another life of some server since (this server
-- was a replica meanwhile, say, and is master again after a partial resync, which keeps
-- its Lua state): writes that life made may be missing here, so a new term is drawn,
-- and every state built earlier is stale. `write`: the call may write (else the
-- marker is brought up to date by the next call that may).
--
-- Writes of this life that are gone (a key of ours vanished before its time, keys
-- evicted: see `kept`, `memory`) are lost writes too: a new term, whose holding waits
-- for the instances that were on this life's old term (see lose). `...`: the other
-- keys of ours the call relies on (its order stream, a lease), looked at the same way.
local function current_term(marker, write, ...)
  local fresh = not term
  if fresh then
    draw()
  end
  local now = clock()
  local m = marker and redis.call('GET', marker)
  local lost = evicted_since(now) or (marker and vanished(marker, m, now))
  for i = 1, select('#', ...) do
    local key = select(i, ...)
    lost = lost or vanished(key, redis.call('EXISTS', key) == 1, now)
  end
  if lost and not fresh then
    lose()
  end
  if marker then
    if m ~= term then
      if m and not known[m] then
        known[m] = true
        ncame_after = ncame_after + 1
        came_after[ncame_after] = m
        -- (A fresh life's term is new anyway.)
        if not fresh then
          draw()
        end
      end
      if write then
        redis.call('SET', marker, term)
        kept[marker] = FOREVER
      end
    end
  end
  return term
end

-- A sale's fields that are not buyer records. `gen` changes with every move that can
-- add a buyer or bring a unit back (an admission, a release, a settle, a load): while it
-- stays, a sold-out sale's buyers are the same (see seckill_peek).
-- `part` is set only in the parts of a segmented sale (`<part>/<parts>`), and carried by
-- its orders' stream entries.
-- `epoch` is the build of the state Postgres recorded (the fence: the worker writes an
-- order only of the sale's current epoch); a load writes `next_epoch` instead, and the
-- state is armed (`epoch` set) once Postgres has committed it (seckill_arm). A state
-- without `epoch` admits nothing.
-- A lottery sale (see `draw`) adds `lottery_end` (the end of its entry window, in ms;
-- gone once drawn) and `lottery_seed` (the draw's secret seed, hex); the draw leaves its
-- record: `drawn_ms`, `draw_entrants`, `draw_winners` (user ids joined by commas), and
-- `unrecorded` until Postgres records it (seckill_recorded): till then the state answers
-- every press `drawing`, so no answer names an order of a draw Redis could still lose.
local SALE_FIELDS = {'stock', 'begin_ms', 'end_ms', 'term', 'gen', 'part', 'epoch', 'next_epoch',
  'lottery_end', 'lottery_seed', 'drawn_ms', 'draw_entrants', 'draw_winners', 'unrecorded'}
-- The draw's record, carried over when a sale's state is rebuilt.
local DRAW_FIELDS = {'lottery_seed', 'drawn_ms', 'draw_entrants', 'draw_winners', 'unrecorded'}

-- A count as Redis stored it (stock): nil when missing or corrupt.
local function whole(v)
  if v and string.match(v, '^%d+$') then
    return tonumber(v)
  end
  return nil
end

-- Whether a buyer record names an order id (a positive 64-bit integer).
local function order_like(v)
  return string.match(v, '^[1-9]%d*$') ~= nil and #v <= 19
end

-- Whether a buyer record marks an entrant of a lottery not drawn yet: `e<order_id>`,
-- the order the entrant gets if drawn.
local function entrant_like(v)
  return string.sub(v, 1, 1) == 'e' and order_like(string.sub(v, 2))
end

-- User ids (digits, no leading zero) in numeric order, exactly, at any length.
local function id_before(a, b)
  return #a < #b or (#a == #b and a < b)
end

local TWO_TO_52 = 4503599627370496

-- The draw's random numbers: the first 52 bits of SHA-1(seed .. ':' .. c), c = 0, 1, 2,
-- ... in turn; a uniform pick among m takes the next number below the largest multiple
-- of m under 2^52 (so no pick is favoured) and keeps its remainder by m.
local function pick(seed, state, m)
  local limit = m * math.floor(TWO_TO_52 / m)
  while true do
    local r = tonumber(string.sub(redis.sha1hex(seed .. ':' .. state.c), 1, 13), 16)
    state.c = state.c + 1
    if r < limit then
      return r % m
    end
  end
end

-- HSET or HDEL of many fields, in chunks the Lua stack takes.
local function in_chunks(cmd, key, args)
  for i = 1, #args, 1000 do
    redis.call(cmd, key, unpack(args, i, math.min(i + 999, #args)))
  end
end

-- A lottery sale's draw, once its window is over (the first admission call to find it
-- so): the entrants are the users with an entrant mark, in increasing user id; a
-- partial Fisher-Yates shuffle with `pick` chooses min(stock, entrants) of them, in
-- order, and each winner is admitted as an admission would (buyer record, unit,
-- stream entry with the state's epoch) under the order id minted when they entered;
-- the others' marks go. The record (seed, entrants, winners) stays in the state, for
-- anyone to check against the commitment published when the sale was created
-- (scripts/verify-draw recomputes the winners), marked `unrecorded` until Postgres
-- records it.
local function draw_lottery(s, stream, voucher, now_s)
  local all = redis.call('HGETALL', s.key)
  local seed, entrants, orders = nil, {}, {}
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    if f == 'lottery_seed' then
      seed = v
    elseif string.sub(f, 1, 2) == 'u:' and entrant_like(v) then
      local user = string.sub(f, 3)
      entrants[#entrants + 1] = user
      orders[user] = string.sub(v, 2)
    end
  end
  if not seed or not string.match(seed, '^%x+$') then
    return false
  end
  table.sort(entrants, id_before)
  local n = #entrants
  local k = math.min(s.stock, n)
  local order, state = {}, {c = 0}
  for i = 1, n do
    order[i] = entrants[i]
  end
  for i = 1, k do
    local j = i + pick(seed, state, n - i + 1)
    order[i], order[j] = order[j], order[i]
  end
  local won, gone, winners = {}, {}, {}
  for i = 1, n do
    local user = order[i]
    if i <= k then
      won[#won + 1] = 'u:' .. user
      won[#won + 1] = orders[user]
      winners[i] = user
    else
      gone[#gone + 1] = 'u:' .. user
    end
  end
  -- The winners' orders, as admissions' entries of at most 128 orders each.
  for first = 1, k, 128 do
    local last = math.min(first + 127, k)
    local entry = {'orders', string.format('%d', last - first + 1), 'admitted_ms', now_s,
      'voucher_id', voucher}
    if s.part then
      entry[#entry + 1] = 'part'
      entry[#entry + 1] = s.part
    end
    entry[#entry + 1] = 'epoch'
    entry[#entry + 1] = s.epoch
    for i = first, last do
      entry[#entry + 1] = 'order_id'
      entry[#entry + 1] = orders[winners[i]]
      entry[#entry + 1] = 'user_id'
      entry[#entry + 1] = winners[i]
    end
    redis.call('XADD', stream, '*', unpack(entry))
    kept[stream] = FOREVER
  end
  in_chunks('HSET', s.key, won)
  in_chunks('HDEL', s.key, gone)
  redis.call('HSET', s.key, 'stock', s.stock - k, 'gen', string.format('%d', (s.gen or 0) + 1),
    'drawn_ms', now_s, 'draw_entrants', table.concat(entrants, ','),
    'draw_winners', table.concat(winners, ','), 'unrecorded', '1')
  redis.call('HDEL', s.key, 'lottery_end')
  return true
end

-- Reads sale `s` for an admission call (its state and the call's buyer records) and
-- judges it: `s.closed` the code every grab of it gets, or its stock, gen, part and
-- epoch; `s.entering` while a lottery's window is open, `s.due` once it is over and
-- not drawn yet, `s.drawing` once drawn and not recorded yet.
local function read_sale(s, this_term, now, marker)
  local fields = s.fields
  local v = redis.call('HMGET', s.key, unpack(fields, 1, s.nfields))
  local stock, begin_ms, end_ms = whole(v[1]), tonumber(v[2]), tonumber(v[3])
  -- A missing field means the state is gone (restart, flush, expiry): fail closed,
  -- never treat a missing stock as "unlimited".
  if not v[1] or not v[2] or not v[3] or not v[7] or (v[6] or '') ~= s.label then
    s.closed = 1
  elseif not stock or not begin_ms or not end_ms or not whole(v[7])
      or (v[8] and not whole(v[8])) then
    s.closed = 7
  elseif v[4] ~= this_term then
    s.closed = 6
  elseif whole(v[7]) < s.floor then
    s.closed = 10
  elseif now < begin_ms then
    s.closed = 2
  elseif now >= end_ms then
    s.closed = 3
  elseif opened[marker] ~= this_term then
    s.closed = 9
  else
    s.stock = stock
    s.gen = tonumber(v[5])
    s.part = v[6]
    s.epoch = v[7]
    if v[8] then
      s.entering = now < whole(v[8])
      s.due = not s.entering
    end
    s.drawing = v[9] ~= false or nil
  end
  local held = s.held
  for j = 10, s.nfields do
    local h = v[j]
    if h then
      if not order_like(h) and not (v[8] and entrant_like(h)) then
        s.closed = 7
      end
      held[fields[j]] = h
    end
  end
end

-- Every grab of an admission call (its ARGV, below) answered `code`, nothing taken.
local function refuse_all(argv, code)
  local out = {}
  local i = 2
  while i <= #argv do
    local n = tonumber(argv[i + 4])
    for _ = 1, n do
      out[#out + 1] = code
      out[#out + 1] = 0
    end
    i = i + 5 + 2 * n
  end
  return out
end

-- Flash-sale admission: every check and every write of each grab in one atomic step.
--
-- Grabs that arrive together for one shard are decided by one call, one after the
-- other, each exactly as if it ran alone (a user's second grab in the same call sees the
-- first): coalescing saves Redis the per-call cost (lookup, argument parsing, reply),
-- which was most of its work per grab. For the same reason each sale is read with ONE
-- HMGET (its state and the buyer records of every user in the call) and written with
-- ONE HSET (stock and the new buyers), and the call's orders go to the stream as ONE
-- entry (a command per order was nearly half of Redis's work per grab; the worker
-- acknowledges the entry once all its orders are settled). The call is atomic, so
-- nobody can change a record between that read and that write, and every sale is
-- checked (loaded, of this term, not corrupt) before anything is written.
--
-- A sale is one hash: `stock`, `begin_ms`, `end_ms`, `term`, `gen`, `epoch`, and a field
-- `u:<user_id>` holding the order id of each buyer (so buyer records expire with the
-- sale). All keys share the shard's hash tag, so this is valid on Redis Cluster. `gen`
-- moves with every call that adds a buyer (and every unit that comes back, and every
-- load): while it stays, a sale's buyers are the same (see seckill_peek). Each order's
-- entry carries the epoch of the state that admitted it.
-- KEYS[1] the shard's order stream (stream.orders)  KEYS[2] the shard's term marker
-- KEYS[3..] the sale hashes
-- ARGV[1] '1': write even when nothing is admitted (the caller waits for replicas after
-- this call: a write makes that wait cover every earlier write, other clients' included,
-- so an `already ordered` answer never names an order a failover could still undo)
-- ARGV[2..]: the grabs, in order, as runs: grabs in a row of one sale are one run, of
-- five values (index of the sale hash in KEYS, voucher_id, the part's label as the
-- caller routed it ('' for a sale in one part), the epoch the caller knows Postgres
-- names for the part ('0': none known), the number N of its grabs) and then two per
-- grab (user_id, order_id minted by the API): 5 + 2N values. A state whose `part` is
-- not the label the caller expects is answered as not loaded (1): a grab routed before
-- the caller knew the sale's parts must not be decided in another user's part. A state
-- of an epoch below the one the caller knows is answered as fenced (10): Postgres has
-- named a later build since, on another server (an old primary still taking writes
-- after a failover), and this state's orders would never be written.
--
-- Returns, per grab, two values: code, order_id (0 when none), and, when any grab was
-- admitted, the id of the call's stream entry last. Codes:
--   0 admitted (order_id), 1 not loaded (or not armed yet), 2 not started, 3 ended,
--   4 already ordered (the existing order_id), 5 sold out, 6 stale (built in another
--   term: to be rebuilt from Postgres), 7 corrupt (a field that is not a number: to be
--   rebuilt from Postgres), 8 part drained (a part of a segmented sale has no unit left:
--   the caller moves units to it from the sale's other parts, or answers sold out),
--   9 held (the sale is open, but this term is not opened yet: see `opened`),
--   10 fenced (an older build than Postgres's: see ARGV above; nothing is taken),
--   11 entered (a lottery's window is open: the user is an entrant, order_id the order
--   they get if drawn; the first call after the window draws, see draw_lottery; in a
--   part of a segmented sale, the window is over and the draw is not in yet),
--   12 drawing (a lottery sale drawn and not recorded yet, or a part of a segmented
--   one whose window is over and whose draw has not rebuilt it yet; nothing is taken:
--   the caller waits for the draw),
--   13 evicting (this server's maxmemory-policy may evict keys: no grab is decided,
--   nothing is read or taken, as no answer could be a promise; see `memory`)
local function admit(keys, argv)
  local this_term = current_term(keys[2], true, keys[1])
  if memory.evicts then
    return refuse_all(argv, 13)
  end
  local now = clock()
  local now_s = string.format('%d', now)

  -- Each sale once (by its index in KEYS) with the fields to read for it, and each
  -- grab's buyer field (by the grab's number in the call).
  local sales, order_of_sales, nsales = {}, {}, 0
  local buyers, ngrabs = {}, 0
  local last_arg = #argv
  local i = 2
  while i <= last_arg do
    local k = argv[i]
    local s = sales[k]
    if not s then
      s = {key = keys[tonumber(k)], voucher = argv[i + 1],
        fields = {'stock', 'begin_ms', 'end_ms', 'term', 'gen', 'part', 'epoch', 'lottery_end',
          'unrecorded'},
        nfields = 9, held = {}, new = {}, nnew = 0}
      sales[k] = s
      nsales = nsales + 1
      order_of_sales[nsales] = s
    end
    s.label = argv[i + 2]
    s.floor = tonumber(argv[i + 3]) or 0
    local first = i + 5
    i = first + 2 * tonumber(argv[i + 4])
    local fields, n = s.fields, s.nfields
    for j = first, i - 1, 2 do
      local buyer = 'u:' .. argv[j]
      n = n + 1
      fields[n] = buyer
      ngrabs = ngrabs + 1
      buyers[ngrabs] = buyer
    end
    s.nfields = n
  end
  for m = 1, nsales do
    local s = order_of_sales[m]
    read_sale(s, this_term, now, keys[2])
    if s.due and not s.closed and s.part then
      -- A segmented sale's draw spans its parts (other slots, other servers): Postgres
      -- makes it from every part's entrants and rebuilds each part with its winners.
      s.drawing = true
    elseif s.due and not s.closed then
      if draw_lottery(s, keys[1], s.voucher, now_s) then
        s.held, s.due = {}, nil
        read_sale(s, this_term, now, keys[2])
      else
        s.closed = 7
      end
    end
  end

  local out = {}
  -- The call's orders, as ONE stream entry: `orders` N, `admitted_ms`, then per sale
  -- `voucher_id` (and `part`) and `epoch`, followed by `order_id`, `user_id` of each of
  -- its orders.
  local entry, ne, nadmitted, run_head = {'orders', 0, 'admitted_ms', now_s}, 4, 0, nil
  local g = 0
  i = 2
  while i <= last_arg do
    local s, voucher = sales[argv[i]], argv[i + 1]
    local first = i + 5
    i = first + 2 * tonumber(argv[i + 4])
    for j = first, i - 1, 2 do
      g = g + 1
      local buyer = buyers[g]
      local held = s.held[buyer]
      local code, id = 0, 0
      if s.closed then
        code = s.closed
      elseif s.drawing then
        -- An entrant waits for the draw under its entry; anyone else for the part's
        -- rebuild after it.
        if held and entrant_like(held) then
          code, id = 11, string.sub(held, 2)
        else
          code = 12
        end
      elseif s.entering and held and entrant_like(held) then
        -- Entered already (an entrant counts once): the order it gets if drawn.
        code, id = 11, string.sub(held, 2)
      elseif s.entering and not held then
        local order = argv[j + 1]
        s.held[buyer] = 'e' .. order
        local new, n = s.new, s.nnew
        new[n + 1] = buyer
        new[n + 2] = 'e' .. order
        s.nnew = n + 2
        code, id = 11, order
      elseif held then
        -- Already ordered comes before sold out.
        code, id = 4, held
      elseif s.stock <= 0 then
        code = s.part and 8 or 5
      else
        local order = argv[j + 1]
        s.stock = s.stock - 1
        s.held[buyer] = order
        local new, n = s.new, s.nnew
        new[n + 1] = buyer
        new[n + 2] = order
        s.nnew = n + 2
        if run_head ~= s then
          -- The sale (and part) of the orders that follow in the entry.
          entry[ne + 1] = 'voucher_id'
          entry[ne + 2] = voucher
          ne = ne + 2
          if s.part then
            entry[ne + 1] = 'part'
            entry[ne + 2] = s.part
            ne = ne + 2
          end
          entry[ne + 1] = 'epoch'
          entry[ne + 2] = s.epoch
          ne = ne + 2
          run_head = s
        end
        entry[ne + 1] = 'order_id'
        entry[ne + 2] = order
        entry[ne + 3] = 'user_id'
        entry[ne + 4] = argv[j]
        ne = ne + 4
        nadmitted = nadmitted + 1
        id = order
      end
      out[2 * g - 1] = code
      out[2 * g] = id
    end
  end
  local wrote = false
  local entry_id
  if nadmitted > 0 then
    entry[2] = string.format('%d', nadmitted)
    entry_id = redis.call('XADD', keys[1], '*', unpack(entry, 1, ne))
    kept[keys[1]] = FOREVER
  end
  for m = 1, nsales do
    local s = order_of_sales[m]
    if s.nnew > 0 then
      local new, n = s.new, s.nnew
      if s.gen then
        new[n + 1] = 'gen'
        new[n + 2] = string.format('%d', s.gen + 1)
        n = n + 2
      end
      redis.call('HSET', s.key, 'stock', s.stock, unpack(new, 1, n))
      wrote = true
    end
  end
  if argv[1] == '1' and not wrote then
    for m = 1, nsales do
      local s = order_of_sales[m]
      if s.stock then
        redis.call('HSET', s.key, 'stock', s.stock)
        break
      end
    end
  end
  -- (The entry's id last, when there is one: the instance keeps its 202s until the
  -- entry is acknowledged, see src/admission/promises.rs.)
  if entry_id then
    out[2 * g + 1] = entry_id
  end
  return out
end

-- Admits again, under its own id, an order a worker found stale (admitted by a state
-- that is no longer its sale's: an old primary's) or gone (its entry lost with Redis's
-- data, say by a restart from an older copy): when the sale's current state still has a
-- unit for it and its user holds no other order there, it takes the unit, records the
-- buyer and appends the order to the stream stamped with this state's epoch, exactly as
-- an admission would have; a worker then writes it from there like any other. A 202
-- whose copy Redis lost (a failover that handed its acknowledgement to a replica then
-- resynchronized from elsewhere) is kept this way whenever the sale can still keep it.
-- KEYS[1] the shard's order stream  KEYS[2] its term marker  KEYS[3] the sale's (part's)
-- hash  ARGV[1] Postgres's epoch of the part  ARGV[2] voucher_id  ARGV[3] user_id
-- ARGV[4] order_id  ARGV[5] its admission time (ms)
-- Returns {1, the new entry's id} admitted again now, {0, the stream's last entry id}
-- admitted already (the buyer record names it: its entry, wherever it is, is no later),
-- {-1} this is not the sale's current state (missing, not armed, stale, corrupt, of
-- another epoch: to be tried where the sale lives), {4} the user holds another order,
-- {5} no unit left, {8} no unit left in this part of a segmented sale (units may be
-- moved to it by a grab).
local function adopt(keys, argv)
  local this_term = current_term(keys[2], true, keys[1])
  local buyer = 'u:' .. argv[3]
  local v = redis.call('HMGET', keys[3], 'stock', 'begin_ms', 'end_ms', 'term', 'epoch', 'part', 'gen', buyer)
  local stock = whole(v[1])
  if not stock or not tonumber(v[2]) or not tonumber(v[3]) or v[4] ~= this_term
      or v[5] ~= argv[1] then
    return {-1}
  end
  if v[8] ~= argv[4] and v[8] then
    return {4}
  end
  if v[8] then
    local last = redis.call('XREVRANGE', keys[1], '+', '-', 'COUNT', 1)
    return {0, last[1] and last[1][1] or ''}
  end
  if stock <= 0 then
    return {v[6] and 8 or 5}
  end
  local fields = {'stock', stock - 1, buyer, argv[4]}
  if tonumber(v[7]) then
    fields[5] = 'gen'
    fields[6] = string.format('%d', tonumber(v[7]) + 1)
  end
  redis.call('HSET', keys[3], unpack(fields))
  local entry = {'orders', '1', 'admitted_ms', argv[5], 'voucher_id', argv[2]}
  if v[6] then
    entry[#entry + 1] = 'part'
    entry[#entry + 1] = v[6]
  end
  entry[#entry + 1] = 'epoch'
  entry[#entry + 1] = v[5]
  entry[#entry + 1] = 'order_id'
  entry[#entry + 1] = argv[4]
  entry[#entry + 1] = 'user_id'
  entry[#entry + 1] = argv[3]
  local id = redis.call('XADD', keys[1], '*', unpack(entry))
  kept[keys[1]] = FOREVER
  return {1, id}
end

-- The id below which consumer group `group` is done with every entry of `stream`
-- (acknowledged): its oldest pending entry, or just past its last delivered one; ''
-- when it cannot tell (no stream, no group).
local function done_below(stream, group)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if not ok then
    return ''
  end
  for _, g in ipairs(groups) do
    local name, last
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] end
      if g[j] == 'last-delivered-id' then last = g[j + 1] end
    end
    if name == group then
      local pending = redis.call('XPENDING', stream, group)
      if pending[1] > 0 then
        return pending[2]
      end
      local ms, seq = string.match(last, '^(%d+)-(%d+)$')
      if not ms then
        return ''
      end
      return ms .. '-' .. string.format('%d', tonumber(seq) + 1)
    end
  end
  return ''
end

-- The server's term and how long ago (ms) it was drawn, and, read in the same instant,
-- where the workers are done in each stream given: an instance forgets the 202s it
-- keeps below that, only while the term it read is the one it has seen (a server that
-- lost writes shows a new term first). It writes nothing (the marker is brought up to
-- date by the next call that writes), so it answers on a master that refuses writes for
-- want of replicas too.
-- KEYS[1] the term marker of the slot asked about (keys::Keys::term_marker)
-- KEYS[2..] order streams of that server  ARGV[1] the consumer group (when streams)
-- Returns {term, age in ms, per stream the id it is done below ('' unknown), the terms
-- of the lives whose data this one took over (space-separated, '' none seen: see
-- `came_after`), and last 1 opened or 0 held (see `opened`)}.
local function term_of(keys, argv)
  current_term(keys[1], false, unpack(keys, 2))
  local now = clock()
  for k = 2, #keys do
    if redis.call('EXISTS', keys[k]) == 1 then
      kept[keys[k]] = FOREVER
    end
  end
  local out = {term, now - term_ms}
  -- A slot whose marker is not this term's may have lost its data (a FLUSHALL keeps the
  -- term): nothing is known done there until a write brings the marker back.
  local intact = redis.call('GET', keys[1]) == term
  for k = 2, #keys do
    out[#out + 1] = intact and done_below(keys[k], argv[1]) or ''
  end
  out[#out + 1] = table.concat(came_after, ' ')
  out[#out + 1] = opened[keys[1]] == term and 1 or 0
  return out
end

-- Creates the consumer group `ARGV[1]` of order stream KEYS[1] (and the stream) if
-- missing, after a look at the stream's term marker KEYS[2]: a stream that vanished
-- is lost writes (current_term) before it is made anew here. Returns 1 created, 0 there
-- already.
local function create_group(keys, argv)
  current_term(keys[2], true, keys[1])
  local made = redis.pcall('XGROUP', 'CREATE', keys[1], argv[1], '0', 'MKSTREAM')
  kept[keys[1]] = FOREVER
  if type(made) == 'table' and made.err then
    if string.find(made.err, 'BUSYGROUP', 1, true) then
      return 0
    end
    return made
  end
  return 1
end

-- Draws a new term (a process saw the server's identity change): every sale's state is
-- then stale until rebuilt. KEYS[1] as for seckill_term.
local function new_term(keys, argv)
  draw()
  return term_of(keys, argv)
end

-- Opens term ARGV[1] on the term markers KEYS (every shard of the server): their sales
-- admit again. Returns 1, or 0 when the server's term is another by now (that one stays
-- held).
local function open_term(keys, argv)
  for _, marker in ipairs(keys) do
    if current_term(marker, true) ~= argv[1] then
      return 0
    end
  end
  for _, marker in ipairs(keys) do
    opened[marker] = argv[1]
  end
  return 1
end

-- Claims an order-id node lease if free, or held by `token` already (a claim whose
-- answer was lost, or whose replicas did not acknowledge in time, is retried with the
-- same number and token: it does not leave a number leased to nobody).
-- KEYS[1] the lease  KEYS[2] its slot's term marker  ARGV[1] our token  ARGV[2] time to
-- live (ms)
-- Returns {1 claimed or 0 held by another, age of the term in ms}: a term younger than
-- a lease's renewal window means this server may have lost a live holder's lease.
local function claim_lease(keys, argv)
  current_term(keys[2], true, keys[1])
  -- The marker of a lease's slot lives as long as the lease: a number claimed lives
  -- later would otherwise meet a marker of a life long gone, and draw a term for it.
  redis.call('PEXPIRE', keys[2], argv[2])
  local claimed = redis.call('SET', keys[1], argv[1], 'NX', 'PX', argv[2])
  if not claimed and redis.call('GET', keys[1]) == argv[1] then
    redis.call('PEXPIRE', keys[1], argv[2])
    claimed = true
  end
  local now = clock()
  kept[keys[2]] = now + tonumber(argv[2])
  if claimed then
    kept[keys[1]] = now + tonumber(argv[2])
  end
  return {claimed and 1 or 0, now - term_ms}
end

-- Renews an order-id node lease.
-- KEYS[1] the lease  KEYS[2] its slot's term marker  ARGV[1] our token  ARGV[2] time to
-- live (ms)
-- Returns 1 extended, 2 re-created (the key was gone: Redis lost its data), 0 lost
-- (another process holds the number now).
local function renew_lease(keys, argv)
  current_term(keys[2], true, keys[1])
  redis.call('PEXPIRE', keys[2], argv[2])
  local until_ms = clock() + tonumber(argv[2])
  kept[keys[2]] = until_ms
  local holder = redis.call('GET', keys[1])
  if holder == argv[1] then
    redis.call('PEXPIRE', keys[1], argv[2])
    kept[keys[1]] = until_ms
    return 1
  end
  if not holder then
    redis.call('SET', keys[1], argv[1], 'PX', argv[2])
    kept[keys[1]] = until_ms
    return 2
  end
  return 0
end

-- What a sale's state says now, for an API instance that remembers sold-out, not yet
-- open and ended sales and answers their grabs itself (src/admission/edge.rs).
-- KEYS[1] the sale hash  KEYS[2] the shard's term marker
-- Returns {code}: 1 not loaded (or not armed), 6 stale, 7 corrupt (as seckill_admit);
-- or {0, now_ms, begin_ms, end_ms, stock, gen ('' when none), term, epoch, window}, the
-- clock being the one admission reads, `window` 1 while the state holds a lottery's
-- window not drawn yet (its stock is not yet what the draw leaves it) or a draw not
-- recorded yet (its answers wait for the record), else 0.
local function peek(keys, argv)
  local now = clock()
  local v = redis.call('HMGET', keys[1], 'stock', 'begin_ms', 'end_ms', 'term', 'gen', 'epoch',
    'lottery_end', 'unrecorded')
  if not v[1] or not v[2] or not v[3] or not v[6] then
    return {1}
  elseif not whole(v[1]) or not tonumber(v[2]) or not tonumber(v[3]) then
    return {7}
  elseif v[4] ~= current_term(keys[2], false) then
    return {6}
  end
  -- (A gen that is not a number tells nothing: '' as if none.)
  local gen = (v[5] and tonumber(v[5])) and v[5] or ''
  return {0, string.format('%d', now), v[2], v[3], v[1], gen, v[4], v[6],
    (v[7] or v[8]) and 1 or 0}
end

-- Arms a state a load wrote (its `next_epoch`) once Postgres committed that epoch:
-- from now on it admits, stamping its entries with it.
-- KEYS[1] the sale hash  KEYS[2] the shard's term marker  ARGV[1] the epoch
-- Returns 1 armed, 0 not (another load wrote the state since, or it is gone).
local function arm(keys, argv)
  current_term(keys[2], true)
  if redis.call('HGET', keys[1], 'next_epoch') ~= argv[1] then
    return 0
  end
  redis.call('HSET', keys[1], 'epoch', argv[1])
  redis.call('HDEL', keys[1], 'next_epoch')
  return 1
end

-- A part of a segmented lottery sale, read for its draw (src/admission/lottery/parts.rs):
-- once its window is over by this server's clock (admission then makes no entry more in
-- it, see code 12), every entrant mark it holds, read in the same instant.
-- KEYS[1] the part's hash  KEYS[2] the shard's term marker
-- Returns {0, epoch, user_id, order_id, user_id, order_id, ...} (its entrants, in no
-- order); {1} no window to draw (not loaded, not armed, not of this term, or rebuilt
-- since its draw); {2} its window is still open; {3} the sale has ended (or was closed):
-- no draw, as a sale in one part never draws once ended.
local function entries(keys, argv)
  local now = clock()
  local v = redis.call('HMGET', keys[1], 'lottery_end', 'epoch', 'term', 'end_ms')
  if not v[1] or not whole(v[2]) or v[3] ~= current_term(keys[2], false) then
    return {1}
  elseif now < (tonumber(v[1]) or 0) then
    return {2}
  elseif now >= (tonumber(v[4]) or 0) then
    return {3}
  end
  local all, out = redis.call('HGETALL', keys[1]), {0, v[2]}
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 2) == 'u:' and entrant_like(all[i + 1]) then
      out[#out + 1] = string.sub(all[i], 3)
      out[#out + 1] = string.sub(all[i + 1], 2)
    end
  end
  return out
end

-- Marks a sale's draw recorded in Postgres: its presses are answered from it again.
-- KEYS[1] the sale hash  KEYS[2] the shard's term marker  ARGV[1] the draw's
-- `drawn_ms`  ARGV[2] its `draw_winners`, as Postgres recorded them
-- Returns 1 marked, 0 not (the state holds no such draw: another draw, or none, is not
-- marked by this record).
local function recorded(keys, argv)
  current_term(keys[2], true)
  local v = redis.call('HMGET', keys[1], 'drawn_ms', 'draw_winners')
  if v[1] ~= argv[1] or (v[2] or '') ~= argv[2] then
    return 0
  end
  redis.call('HDEL', keys[1], 'unrecorded')
  return 1
end

local function version()
  return {VERSION, CODE}
end

redis.register_function('seckill_admit', admit)
redis.register_function('seckill_adopt', adopt)
redis.register_function{function_name = 'seckill_term', callback = term_of, flags = {'no-writes'}}
redis.register_function{function_name = 'seckill_new_term', callback = new_term, flags = {'no-writes'}}
redis.register_function('seckill_open_term', open_term)
redis.register_function('seckill_group', create_group)
redis.register_function('seckill_claim_lease', claim_lease)
redis.register_function('seckill_renew_lease', renew_lease)
redis.register_function('seckill_arm', arm)
redis.register_function('seckill_recorded', recorded)
redis.register_function{function_name = 'seckill_peek', callback = peek, flags = {'no-writes'}}
redis.register_function{function_name = 'seckill_entries', callback = entries, flags = {'no-writes'}}
redis.register_function{function_name = 'seckill_version', callback = version, flags = {'no-writes'}}
