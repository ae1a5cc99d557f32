-- Like seckill.lua, but each connection waits DELAY_MS between requests, to hold a
-- steady rate (about connections * 1000 / (DELAY_MS + latency) requests per second).
--
--   wrk -t2 -c64 -d10s -s load/wrk/seckill-paced.lua URL -- VOUCHER_ID TOKENS_FILE 2 DELAY_MS
dofile("load/wrk/seckill.lua")

local base_init = init
function init(args)
  base_init(args)
  pause_ms = tonumber(args[4] or "0")
end

function delay()
  return pause_ms
end
