-- Shared by every bench script: one machine-readable line when wrk is done.
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK_RESULT %d %d %d %d %d %d %d %.0f %.0f %.0f\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
