-- A plain GET of the URL given to wrk; only the report is added.
dofile(os.getenv("BENCH_LUA") .. "/report.lua")
