-- Fenced POSTs: wrk <url> -s fenced.lua -- PATH RUN BASE RESOURCES [LIMIT [OWNER FENCE...]]
--   PATH       the request path (/tool/act through the gateway)
--   RUN        a word unique to this run: the body carries it and a counter, so every call's
--              derived idempotency key is new and nothing is a replay
--   BASE       resource prefix; RESOURCES resources BASE0..BASE(n-1), or BASE itself when 1
--   LIMIT      stop after this many answers (0: run for wrk's -d)
--   OWNER, FENCE...  gateway-issued leases: the owner and one fence per resource, in order
-- With an external issuer every call presents fence 1: an equal fence is accepted, so no
-- call is stale and none waits for an older one.
dofile(os.getenv("BENCH_LUA") .. "/report.lua")

local path, run, base, resources, limit, owner
local fences = {}
local sent, answered = 0, 0

function init(args)
  path, run, base = args[1], args[2], args[3]
  resources = tonumber(args[4])
  limit = tonumber(args[5] or "0")
  owner = args[6]
  for i = 7, #args do fences[i - 7] = args[i] end
end

function request()
  local i = sent % resources
  sent = sent + 1
  local resource = base
  if resources > 1 then resource = base .. i end
  local headers = {
    ["Content-Type"] = "application/json",
    ["X-Lease-Resource"] = resource,
    ["X-Fence-Token"] = fences[i] or "1",
  }
  if owner then headers["X-Lease-Owner"] = owner end
  return wrk.format("POST", path, headers, '{"run":"' .. run .. '","n":' .. sent .. '}')
end

function response(status, headers, body)
  answered = answered + 1
  if limit > 0 and answered == limit then
    io.write("WRK_LIMIT\n")  -- the bench stops wrk with SIGINT: it then reports at once
    io.flush()
    wrk.thread:stop()
  end
end
