-- Deletes the group's consumers that hold nothing and have been idle at least ARGV[2]
-- ms (dead workers). One atomic step: a consumer that reads between a look and a
-- delete would otherwise lose its fresh pending entries with it.
-- KEYS[1] the stream  ARGV[1] group  ARGV[2] idle ms.  Returns how many went.
local gone = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local name, pending, idle
  for i = 1, #c, 2 do
    if c[i] == 'name' then name = c[i + 1]
    elseif c[i] == 'pending' then pending = c[i + 1]
    elseif c[i] == 'idle' then idle = c[i + 1] end
  end
  if name and pending == 0 and idle and idle >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name)
    gone = gone + 1
  end
end
return gone
