-- wrk script: every request is a grab by the next distinct user.
--
--   wrk -t2 -c64 -d10s -s load/wrk/seckill.lua http://127.0.0.1:8080 -- VOUCHER_ID TOKENS_FILE 2
--
-- VOUCHER_ID may be a comma-separated list: requests then go round the vouchers.
--
-- Needs on the server: RATE_LIMIT_PER_IP=0 (the default; all of wrk's connections share
-- one address). The per-user limit may stay on: a user comes round again only after the
-- whole file (100,000 users at 50,000 requests/s: every 2 s, under 5 grabs/s).
--
-- TOKENS_FILE holds one bearer token per line (`seckill token --user 1 --count 100000`).
-- The last argument repeats wrk's thread count (-t): thread k takes tokens k, k+T, k+2T...,
-- so no two requests share a user until the file wraps.
-- wrk reports answers outside 2xx as "Non-2xx or 3xx responses"; every 2xx answer of
-- this route is a 202. (No response() callback: it would make wrk parse every answer
-- into Lua, and wrk shares the machine with the service.)

local next_id = 0

function setup(thread)
  thread:set("thread_id", next_id)
  next_id = next_id + 1
end

function init(args)
  local voucher = args[1] or error("usage: -- VOUCHER_ID TOKENS_FILE THREADS")
  local path = args[2] or error("usage: -- VOUCHER_ID TOKENS_FILE THREADS")
  local total_threads = tonumber(args[3] or "1")
  local me = thread_id or 0
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
