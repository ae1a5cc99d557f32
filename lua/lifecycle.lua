-- Part of the library in lua/seckill.lua (appended to it when loaded): what follows
-- admission in a sale's state. Each looks at its shard's term marker first, like every
-- function of the library that writes (see current_term).

-- Gives a closed (cancelled or expired) order's unit back to the sale's live stock and
-- releases its buyer, so the user may grab again.
--
-- Acts only while the buyer record still names this order: such a record means the
-- order's unit is still out in Redis (admission and loading set a record only together
-- with taking the unit, and a load after the order closed never names it, since it
-- counts Postgres's active orders and returned stock). Deleting the record is what
-- makes the unit come back once: a retry, the outbox drain or a replay finds no record
-- naming the order and changes nothing.
--
-- A state armed with another epoch than Postgres's is not the sale's (an old primary
-- still reachable after a failover): the release is refused there and stays owed, for a
-- process that reaches the sale's own state.
--
-- KEYS[1] the sale hash  KEYS[2] the shard's term marker  ARGV[1] buyer field
-- ARGV[2] the closed order's id  ARGV[3] Postgres's epoch of the part ('' when none)
-- Returns 1 when the unit went back, 0 when there was nothing to release, -1 when the
-- state is of another epoch.
local function release(keys, argv)
  current_term(keys[2], true)
  if argv[3] ~= '' then
    local epoch = redis.call('HGET', keys[1], 'epoch')
    if epoch and epoch ~= argv[3] then
      return -1
    end
  end
  if redis.call('HGET', keys[1], argv[1]) ~= argv[2] then
    return 0
  end
  redis.call('HDEL', keys[1], argv[1])
  if redis.call('HEXISTS', keys[1], 'stock') == 1 then
    redis.call('HINCRBY', keys[1], 'stock', 1)
    -- A unit came back: API instances that remember the sale sold out must look again.
    redis.call('HINCRBY', keys[1], 'gen', 1)
  end
  return 1
end

-- Settles a dead (never-to-be-written) order: if its buyer record still names it,
-- hands the user's record back to the order Postgres holds for them (or drops it) and
-- returns the unit the order took.
--
-- One atomic step, so the unit comes back exactly once: a buyer record naming the
-- dead order means its unit is still out (admission and loading set such a record
-- only together with taking the unit), and this function is the only place that
-- changes that record back. Its stream entry is acknowledged later, with the batch (an
-- entry holds the orders of one admission call): a loader meanwhile finds the order
-- buried in Postgres (under the sale's lock, where burial happens) and does not count
-- it.
--
-- KEYS[1] the sale hash  KEYS[2] the shard's term marker  ARGV[1] buyer field
-- ARGV[2] the dead order id  ARGV[3] the order Postgres holds for the user ('' if none)
-- ARGV[4] '1': return the unit
-- Returns 1 when the buyer record was settled, 0 when it no longer named the order.
local function settle_dead(keys, argv)
  current_term(keys[2], true)
  if redis.call('HGET', keys[1], argv[1]) ~= argv[2] then
    return 0
  end
  if argv[3] ~= '' then
    redis.call('HSET', keys[1], argv[1], argv[3])
  else
    redis.call('HDEL', keys[1], argv[1])
  end
  if argv[4] == '1' and redis.call('HEXISTS', keys[1], 'stock') == 1 then
    redis.call('HINCRBY', keys[1], 'stock', 1)
    -- A unit came back: API instances that remember the sale sold out must look again.
    redis.call('HINCRBY', keys[1], 'gen', 1)
  end
  return 1
end

-- Ends a sale now (an administrator's close). Atomic with admission: a grab decided
-- before this is admitted as usual, every grab after it hears `ended`.
--
-- end_ms becomes the Redis clock's now (the clock admission uses) unless it is already
-- earlier; begin_ms at most one millisecond before it, so a sale closed before it
-- opened reads as ended, never as about to open. A state armed with another epoch than
-- Postgres's is not the sale's (an old primary after a failover): closing it would
-- leave the sale's own state open, so it is refused.
-- KEYS[1] the sale hash  KEYS[2] the shard's term marker  ARGV[1] Postgres's epoch of
-- the part ('' when it has none)
-- Returns the sale's end in ms (the Redis clock's now when the sale is not loaded), or
-- -1 when the state is of another epoch.
local function close_sale(keys, argv)
  current_term(keys[2], true)
  local now = clock()
  local cur = redis.call('HMGET', keys[1], 'begin_ms', 'end_ms', 'epoch')
  if not cur[1] or not cur[2] then
    return now
  end
  if argv[1] ~= '' and cur[3] and cur[3] ~= argv[1] then
    return -1
  end
  local finish = math.min(tonumber(cur[2]), now)
  local begin = math.min(tonumber(cur[1]), finish - 1)
  redis.call('HSET', keys[1], 'end_ms', string.format('%d', finish), 'begin_ms', string.format('%d', begin))
  return finish
end

redis.register_function('seckill_release', release)
redis.register_function('seckill_settle_dead', settle_dead)
redis.register_function('seckill_close', close_sale)
