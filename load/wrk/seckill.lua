-- wrk script: every request is a grab by the next distinct user.
--
--   wrk -t2 -c64 -d10s -s load/wrk/seckill.lua http://127.0.0.1:8080 -- VOUCHER_ID TOKENS_FILE 2
--
-- TOKENS_FILE holds one bearer token per line (`seckill token --user 1 --count 100000`).
-- The last argument repeats wrk's thread count (-t): thread k takes tokens k, k+T, k+2T...,
-- so no two requests share a user until the file wraps.
-- Prints the count of each status code at the end.

local threads = {}
local next_id = 0

function setup(thread)
  thread:set("thread_id", next_id)
  next_id = next_id + 1
  table.insert(threads, thread)
end

function init(args)
  voucher = args[1] or error("usage: -- VOUCHER_ID TOKENS_FILE THREADS")
  local path = args[2] or error("usage: -- VOUCHER_ID TOKENS_FILE THREADS")
  tokens = {}
  for line in io.lines(path) do
    if #line > 0 then tokens[#tokens + 1] = line end
  end
  assert(#tokens > 0, "no tokens in " .. path)
  total_threads = tonumber(args[3] or "1")
  position = thread_id or 0
  statuses = {}
  path_ = "/vouchers/" .. voucher .. "/seckill"
end

function request()
  local token = tokens[(position % #tokens) + 1]
  position = position + total_threads
  return wrk.format("POST", path_, { ["Authorization"] = "Bearer " .. token }, "")
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local total = {}
  for _, thread in ipairs(threads) do
    local s = thread:get("statuses")
    for code, n in pairs(s) do
      total[code] = (total[code] or 0) + n
    end
  end
  io.write("status counts:")
  for code, n in pairs(total) do
    io.write(string.format(" %d=%d", code, n))
  end
  io.write("\n")
end
