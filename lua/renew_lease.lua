-- Renews an order-id node lease.
-- KEYS[1] the lease  ARGV[1] our token  ARGV[2] time to live (ms)
-- Returns 1 extended, 2 re-created (the key was gone: Redis lost its data), 0 lost
-- (another process holds the number now).
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
