-- wrk script: every request is a grab by the next distinct user.
--
--   wrk -t2 -c64 -d10s -s load/wrk/seckill.lua http://127.0.0.1:8080 -- VOUCHER_ID TOKENS_FILE 2
--
-- VOUCHER_ID may be a comma-separated list: requests then go round the vouchers.
--
-- Needs on the server: RATE_LIMIT_PER_IP=0 (the default; all of wrk's connections share
-- one address). The per-user limit may stay on: a user comes round again only after the
-- whole file.
--
-- TOKENS_FILE holds one bearer token per line (`target/debug/seckill token --user 1
-- --count 1000000`; `seckill` is not on PATH after scripts/dev). Size it to the run: at
-- least the presses it will send (rate x duration), else the file wraps and every later
-- press is a repeat (`already_ordered`), measuring that path instead; after the run the
-- script says so on stderr when it wrapped.
-- The last argument, THREADS, must repeat wrk's thread count (-t): thread k takes tokens
-- k, k+T, k+2T..., so no two requests share a user until the file wraps. wrk tells a
-- script neither -t nor, before a thread's init runs, how many threads there will be
-- (each thread starts before the next one is set up), so the script cannot count them
-- itself in time; it requires THREADS and, at the end, checks it against the threads
-- setup() counted: a mismatch (users shared between threads, or tokens never sent) is
-- reported and wrk exits 1.
-- wrk reports answers outside 2xx as "Non-2xx or 3xx responses"; every 2xx answer of
-- this route is a 202. (No response() callback: it would make wrk parse every answer
-- into Lua, and wrk shares the machine with the service.)

local usage = "usage: wrk -tT ... -s load/wrk/seckill.lua URL -- VOUCHER_ID TOKENS_FILE T"
local next_id = 0
local threads = {}

function setup(thread)
  thread:set("thread_id", next_id)
  next_id = next_id + 1
  threads[#threads + 1] = thread
end

function init(args)
  local voucher = args[1] or error(usage)
  local path = args[2] or error(usage)
  total_threads = tonumber(args[3] or "")
  if not total_threads or total_threads < 1 or total_threads % 1 ~= 0 then
    error("THREADS (the third argument) must be wrk's -t, a whole number: " .. usage)
  end
  local me = thread_id or 0
  if me >= total_threads then
    error(string.format("THREADS is %d but wrk runs more threads: pass wrk's -t as THREADS", total_threads))
  end
  local targets = {}
  for id in string.gmatch(voucher, "[^,]+") do
    targets[#targets + 1] = "/vouchers/" .. id .. "/seckill"
  end
  -- Requests are built once, up front: the load generator shares the machine with the
  -- service, so it should spend as little as it can per request.
  requests = {}
  local i = 0
  for line in io.lines(path) do
    if #line > 0 then
      if i % total_threads == me then
        local target = targets[(#requests % #targets) + 1]
        requests[#requests + 1] = wrk.format("POST", target, { ["Authorization"] = "Bearer " .. line }, "")
      end
      i = i + 1
    end
  end
  assert(#requests > 0, "no tokens in " .. path)
  count = #requests
  position = 0
end

function request()
  position = position % count + 1
  return requests[position]
end

-- In the main state once every thread has stopped: THREADS against the threads counted,
-- and the presses against the tokens (a press past the file's end repeats a user).
function done(summary, latency, requests)
  local tokens = 0
  for _, thread in ipairs(threads) do
    tokens = tokens + (thread:get("count") or 0)
  end
  if tokens > 0 and summary.requests > tokens then
    io.stderr:write(string.format(
      "seckill.lua: %d presses for %d tokens: the file wrapped, and the %d presses past it " ..
      "repeated users (already_ordered, or rate_limited): mint at least %d tokens for this run\n",
      summary.requests, tokens, summary.requests - tokens, summary.requests))
  end
  local given = threads[1] and threads[1]:get("total_threads")
  if given ~= #threads then
    io.stderr:write(string.format(
      "seckill.lua: THREADS was %s but wrk ran %d threads (-t%d): the users were not split " ..
      "as intended (shared between threads, or some never sent); pass -- ... %d\n",
      tostring(given), #threads, #threads, #threads))
    os.exit(1)
  end
end
