-- wrk script for load/crowd: every request a grab by the next distinct user (as
-- seckill.lua), every answer seen by response(): answers counted by status, and each
-- 202's order id written down, so that every admission can be checked against Postgres.
--
--   wrk -t2 -c64 -d10s --latency -s load/wrk/crowd.lua URL -- TARGET TOKENS_FILE T OUT
--
-- TARGET: a voucher id (POST /vouchers/TARGET/seckill, one token per request), or
-- `healthz` (GET /healthz; TOKENS_FILE is then not read, pass `-`): the baseline of the
-- same shape (requests from a table built up front, every answer through response()).
-- T must repeat wrk's -t (see seckill.lua): thread k takes tokens k, k+T, k+2T...
-- OUT: a path prefix for the files of each thread k:
--   OUT.ids.k     the order_id of every 202 this thread received, one a line
--   OUT.ready.k   made when the thread has built its requests
-- done() prints one line, `crowd: threads=T 200=N 202=N 404=N 409=N 503=N other=N
-- bad202=N` (bad202: a 202 without an order id), the sums over the threads.
--
-- Threads wait for one another before their first request: wrk starts a thread as soon
-- as its init has run, before the next thread's init (which reads the whole token file,
-- a second or so for a million tokens), and starts its clock only after the last one.
-- Without the wait the first thread would storm alone, uncounted by the clock. (The
-- first thread's first request() is wrk's check of the script, from the main thread
-- before the next threads exist: it does not wait.)
-- Needs RATE_LIMIT_PER_IP=0 on the server (all connections share one address).

local usage = "usage: wrk -tT ... -s load/wrk/crowd.lua URL -- TARGET|healthz TOKENS_FILE|- T OUT"
local next_id = 0
local threads = {}

function setup(thread)
  thread:set("thread_id", next_id)
  next_id = next_id + 1
  threads[#threads + 1] = thread
end

local function exists(path)
  local f = io.open(path, "r")
  if f then f:close() return true end
  return false
end

function init(args)
  local target = args[1] or error(usage)
  local path = args[2] or error(usage)
  total_threads = tonumber(args[3] or "")
  out = args[4] or error(usage)
  if not total_threads or total_threads < 1 or total_threads % 1 ~= 0 then
    error("T (the third argument) must be wrk's -t, a whole number: " .. usage)
  end
  local me = thread_id or 0
  if me >= total_threads then
    error(string.format("T is %d but wrk runs more threads: pass wrk's -t as T", total_threads))
  end
  requests = {}
  if target == "healthz" then
    requests[1] = wrk.format("GET", "/healthz")
  else
    local grab = "/vouchers/" .. target .. "/seckill"
    local i = 0
    for line in io.lines(path) do
      if #line > 0 then
        if i % total_threads == me then
          requests[#requests + 1] = wrk.format("POST", grab, { ["Authorization"] = "Bearer " .. line }, "")
        end
        i = i + 1
      end
    end
    assert(#requests > 0, "no tokens in " .. path)
  end
  count = #requests
  position = 0
  c200, c202, c404, c409, c503, cother, bad202 = 0, 0, 0, 0, 0, 0, 0
  ids = assert(io.open(out .. ".ids." .. me, "w"))
  ids:setvbuf("line")
  local ready = assert(io.open(out .. ".ready." .. me, "w"))
  ready:close()
  started = false
  -- wrk calls the first thread's request() once right after its init, from the main
  -- thread, to check the request (before the other threads exist): not a request sent.
  verify_call = (me == 0)
end

local function wait_for_all()
  for k = 0, total_threads - 1 do
    while not exists(out .. ".ready." .. k) do
      os.execute("sleep 0.01")
    end
  end
  started = true
end

function request()
  if not started then
    if verify_call then verify_call = false else wait_for_all() end
  end
  position = position % count + 1
  return requests[position]
end

function response(status, headers, body)
  if status == 202 then
    c202 = c202 + 1
    local id = body and string.match(body, '"order_id"%s*:%s*"?(%d+)')
    if id then ids:write(id, "\n") else bad202 = bad202 + 1 end
  elseif status == 409 then c409 = c409 + 1
  elseif status == 404 then c404 = c404 + 1
  elseif status == 200 then c200 = c200 + 1
  elseif status == 503 then c503 = c503 + 1
  else cother = cother + 1 end
end

-- In the main state once every thread has stopped.
function done(summary, latency, requests)
  local given = threads[1] and threads[1]:get("total_threads")
  if given ~= #threads then
    io.stderr:write(string.format(
      "crowd.lua: T was %s but wrk ran %d threads (-t%d): pass -- ... %d\n",
      tostring(given), #threads, #threads, #threads))
    os.exit(1)
  end
  local sum = { c200 = 0, c202 = 0, c404 = 0, c409 = 0, c503 = 0, cother = 0, bad202 = 0 }
  for _, t in ipairs(threads) do
    for k, _ in pairs(sum) do sum[k] = sum[k] + (t:get(k) or 0) end
  end
  io.write(string.format("crowd: threads=%d 200=%d 202=%d 404=%d 409=%d 503=%d other=%d bad202=%d\n",
    #threads, sum.c200, sum.c202, sum.c404, sum.c409, sum.c503, sum.cother, sum.bad202))
end
