-- Part of the library in lua/seckill.lua (appended to it when loaded): moving units
-- between the parts of a segmented sale (src/admission/parts.rs).
--
-- A move is taken out of the donor here first (with a record of it beside the donor's
-- state), then recorded in Postgres under the sale's lock only while that record is
-- still there, then credited to the recipient here, once. A state rebuilt from
-- Postgres drops the donor's records: a move not yet in Postgres is then void, and the
-- donor has its units back from its allotment.

-- A part's stock when its state is loaded, of this term and sound, and armed (or, when
-- `epoch` is given, armed with it or written with it and being armed: Postgres has
-- committed it); else nil. A state of another epoch than Postgres's is not the sale's
-- (an old primary's after a failover, say). `marker`, `write`: as for current_term.
local function sound_stock(sale, marker, write, epoch)
  local v = redis.call('HMGET', sale, 'stock', 'begin_ms', 'end_ms', 'term', 'epoch', 'next_epoch')
  local stock = whole(v[1])
  if not stock or not tonumber(v[2]) or not tonumber(v[3])
      or v[4] ~= current_term(marker, write) then
    return nil
  end
  if epoch and epoch ~= '' then
    if v[5] ~= epoch and not (not v[5] and v[6] == epoch) then
      return nil
    end
  elseif not v[5] then
    return nil
  end
  return stock
end

-- Takes up to ARGV[2] units out of a part for part ARGV[3], as move ARGV[1].
-- KEYS[1] the donor's hash  KEYS[2] its moves-out hash  KEYS[3] the shard's term marker
-- Returns the units taken (0: none left), or -1 when the state is not sound (missing,
-- stale or corrupt: it is rebuilt before it gives anything) or still holds a lottery's
-- window (its stock is what the draw shares out: the draw's rebuild sets it).
local function take_units(keys, argv)
  local stock = sound_stock(keys[1], keys[3], true)
  if not stock or redis.call('HEXISTS', keys[1], 'lottery_end') == 1 then
    return -1
  end
  local n = math.min(stock, tonumber(argv[2]))
  if n <= 0 then
    return 0
  end
  redis.call('HSET', keys[1], 'stock', stock - n)
  -- (A read of every part that sees no gen move saw no unit leave or arrive: the
  -- refill's sold-out reads rely on it.)
  redis.call('HINCRBY', keys[1], 'gen', 1)
  redis.call('HSET', keys[2], argv[1], argv[3] .. ' ' .. n)
  local expires = redis.call('PEXPIRETIME', keys[1])
  if expires > 0 then
    redis.call('PEXPIREAT', keys[2], expires)
  end
  return n
end

-- The units move ARGV[1] took out of a part, if its record is still there (0: not), or
-- -1 when the part's state is not sound, of this term and of Postgres's epoch ARGV[2]
-- ('' when it has none): a record in a state of another term may be one a rebuild
-- voided, brought back by an older copy of the server, so it is never recorded; the
-- state is rebuilt (and the record dropped) first. A record in a state of another epoch
-- is not the sale's (its current state still holds those units).
-- KEYS[1] the donor's hash  KEYS[2] its moves-out hash  KEYS[3] the shard's term marker
local function taken(keys, argv)
  if not sound_stock(keys[1], keys[3], false, argv[2]) then
    return -1
  end
  local v = redis.call('HGET', keys[2], argv[1])
  if not v then
    return 0
  end
  return tonumber(string.match(v, ' (%d+)$')) or 0
end

-- Credits move ARGV[1] of ARGV[2] units to a part, once.
-- KEYS[1] the recipient's hash  KEYS[2] its moves-in hash  KEYS[3] the shard's term
-- marker  ARGV[3] Postgres's epoch of the recipient ('' when it has none)
-- Returns 1 credited, 0 credited before, -1 the state is not sound (a rebuild from
-- Postgres, whose allotment holds the move, will count the units), -2 the state is of
-- another epoch than Postgres's: not the sale's, so the credit is left to a process
-- that reaches the sale's own state.
local function credit_units(keys, argv)
  if redis.call('HEXISTS', keys[2], argv[1]) == 1 then
    return 0
  end
  local v = redis.call('HGET', keys[1], 'epoch')
  if argv[3] ~= '' and v and v ~= argv[3] then
    return -2
  end
  local stock = sound_stock(keys[1], keys[3], true, argv[3])
  if not stock then
    return -1
  end
  redis.call('HSET', keys[1], 'stock', stock + tonumber(argv[2]))
  -- Units came in: API instances that remember the sale sold out must look again.
  redis.call('HINCRBY', keys[1], 'gen', 1)
  redis.call('HSET', keys[2], argv[1], argv[2])
  local expires = redis.call('PEXPIRETIME', keys[1])
  if expires > 0 then
    redis.call('PEXPIREAT', keys[2], expires)
  end
  return 1
end

redis.register_function('seckill_take', take_units)
redis.register_function{function_name = 'seckill_taken', callback = taken, flags = {'no-writes'}}
redis.register_function('seckill_credit', credit_units)
