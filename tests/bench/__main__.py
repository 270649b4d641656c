"""`make bench`: what a fenced, durable call through the gateway costs, beside what the same
call costs through the proxies a user would run instead, every figure from the same run.

Processes on 127.0.0.1: the tool (tests/bench/upstream.py), the peer (tests/bench/peer.py: a
bare aiohttp pass-through proxy on uvloop), nginx when installed (tests/bench/nginx.py), and
gateways (`python -m gateway serve`, each with its own SQLite file). All load comes from `wrk
-t1` with the Lua scripts in tests/bench/lua (fenced POSTs: fence headers, a body unique to
every call so that no call is a replay).

The machines are shared and noisy, so absolute figures drift, within a run too; every round
runs every measurement back to back (in a rotating order), and each row shows medians over
the rounds. A gateway row's × peer is the median of per-round ratios to the peer measured
right before it (the same request, a measurement of its own), so that the two figures of a
ratio are seconds apart, not minutes; × nginx is the median of per-round ratios to the nginx
row of the same round. The memory row runs last, on a fresh gateway.

Environment: BENCH_ROUNDS (default 5), BENCH_SECONDS per measurement (default 5),
BENCH_MEMORY_CALLS and BENCH_MEMORY_RESOURCES (default 1,000,000 over 100,000), BENCH_QUICK=1
for a short run while developing (2 rounds of 2 s, a memory row of 100,000 calls over 10,000,
a cost table of 100 calls). The cost table (tests/bench/costs.py: instructions per call by
part, from callgrind) needs valgrind; BENCH_COSTS=0 leaves it out. The fdatasync probe
(tests/bench/fsyncs.py) runs on the databases' filesystem before the rounds and after them,
and the store-operation probe (the same module) before them.
The tables are printed and written to var/bench.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.bench import costs, fsyncs, targets, wrk
from tests.bench.nginx import nginx
from tests.harness import REPO_ROOT, GatewayProcess, make_policy, write_policy
from tests.pg import drop_database, run_sync, server_sql, url_of

QUICK = os.environ.get("BENCH_QUICK", "") not in ("", "0")
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2" if QUICK else "5"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "2" if QUICK else "5"))
CONNECTIONS = 32
OVERLOAD_CONNECTIONS = 2000
SPREAD_RESOURCES = 10_000
LEASES = 32
SERIAL_RESOURCES = 100
MEMORY_CALLS = int(os.environ.get("BENCH_MEMORY_CALLS", "100000" if QUICK else "1000000"))
MEMORY_RESOURCES = int(os.environ.get("BENCH_MEMORY_RESOURCES", "10000" if QUICK else "100000"))
RETENTION_S = 30  # the bench's gateways keep receipts and keys this long: a steady database
COSTS = os.environ.get("BENCH_COSTS", "1") not in ("", "0")
SETTLE_AFTER_FLOOD_S = 2.0
PROBE_CONNECTIONS = 16  # beside the 2,000: the latency of calls that were admitted


@dataclass
class Measure:
    name: str
    url: str
    connections: int
    script: str = "get.lua"
    args: Callable[[], tuple[str, ...]] = tuple
    gateway: GatewayProcess | None = None
    fsyncs_here: bool = True
    probe: str | None = None  # a fenced-POST URL for the admitted-latency probe
    baseline: Measure | None = None  # the peer's row for the same request, measured just before
    results: list[wrk.Result] = field(default_factory=list)
    beside: list[wrk.Result] = field(default_factory=list)  # the baseline's, one per result
    cpu_us: list[float] = field(default_factory=list)
    fsync_counts: list[int] = field(default_factory=list)
    probe_p99: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)

    def median(self, value: Callable[[wrk.Result], float]) -> float:
        return statistics.median(value(r) for r in self.results)


def fenced(path: str, base: str, resources: int, *lease: str) -> Callable[[], tuple[str, ...]]:
    """wrk arguments for fenced.lua; a new run word for every measurement."""
    return lambda: (path, secrets.token_hex(6), base, str(resources), "0", *lease)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (/proc/PID/stat fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int, field_name: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field_name} for pid {pid}")


async def _spawn(module: str, *args: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    port = int(await asyncio.wait_for(proc.stdout.readline(), 15))
    return proc, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def process(module: str, *args: str) -> AsyncIterator[str]:
    proc, url = await _spawn(module, *args)
    try:
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already (a Ctrl-C reaches all)
            proc.terminate()
        await proc.wait()


@contextlib.asynccontextmanager
async def gateway_process(
    root: Path, name: str, policy: Path, durability: str, **env: str
) -> AsyncIterator[GatewayProcess]:
    workdir = root / name
    workdir.mkdir(exist_ok=True)
    gateway = GatewayProcess(
        workdir,
        policy,
        sweep_interval_s=1.0,
        extra_env={
            "GATEWAY_DATABASE_URL": f"sqlite:///{workdir / 'bench.db'}",
            "GATEWAY_DURABILITY": durability,
            "GATEWAY_LOG_LEVEL": "WARNING",
            "GATEWAY_RECEIPT_RETENTION_S": str(RETENTION_S),
            **env,
        },
    )
    await gateway.start()
    try:
        yield gateway
    finally:
        if gateway.proc is not None and gateway.proc.poll() is None:
            os.kill(gateway.proc.pid, signal.SIGCONT)
        await gateway.terminate()


@contextlib.contextmanager
def postgres_database() -> Any:
    """A fresh PostgreSQL database's URL, dropped afterwards; None when none answers."""
    name = f"fg_bench_{os.getpid()}_{secrets.token_hex(3)}"
    try:
        run_sync(server_sql, f"CREATE DATABASE {name}")
    except (OSError, TimeoutError):
        yield None
        return
    try:
        yield url_of(name)
    finally:
        drop_database(name)


async def autovacuum_is_off() -> bool:
    return (await server_sql("SHOW autovacuum"))[0][0] == "off"


async def vacuum(urls: list[str]) -> None:
    """What autovacuum would have done on a server running it (the gateway warns at start,
    `postgres_autovacuum_off`, where it does not): the gateway's tables vacuumed and analyzed.
    A database the bench has just filled and nothing has vacuumed nor analyzed
    slows down as it grows: the same load fell from 1,600 to 1,150 calls/s within 20 s here,
    and came back to 1,700 after one VACUUM ANALYZE (which of the two did it, and through
    the plans or the dead rows, was not measured apart)."""
    for url in urls:
        await server_sql("VACUUM ANALYZE", url.rsplit("/", 1)[1])


async def acquire_leases(session: aiohttp.ClientSession, url: str) -> tuple[str, ...]:
    """LEASES gateway-issued leases on lease/0.., held by `bench`: the owner and the fences."""
    fences = []
    for i in range(LEASES):
        async with session.post(
            f"{url}/_gateway/v1/leases/lease/{i}", json={"owner": "bench", "ttl_s": 3600}
        ) as resp:
            assert resp.status == 201, await resp.text()
            fences.append(str((await resp.json())["fence"]))
    return ("bench", *fences)


async def probe(url: str, stop: asyncio.Event) -> list[float]:
    """Fenced POSTs on PROBE_CONNECTIONS connections while wrk runs; the latencies (s) of those
    that were admitted (200). wrk's own percentiles mix them with the fast 503s. Each worker
    is a client that keeps to the protocol on a connection of its own: a shed call is sent
    again after its Retry-After. (From a pool shared by the workers, another worker's call
    could take the connection of one just shed, which the gateway does not read again
    before that second is over, gateway.server.overload: its latency would be the shed
    call's wait, not its own.)"""
    latencies: list[float] = []

    async def one(worker: int) -> None:
        n = 0
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            while not stop.is_set():
                n += 1
                headers = {"X-Lease-Resource": f"par/probe{worker}", "X-Fence-Token": "1"}
                body = b'{"probe": "%s", "n": %d}' % (secrets.token_hex(6).encode(), n)
                started = time.perf_counter()
                try:
                    async with session.post(url, headers=headers, data=body) as resp:
                        await resp.read()
                        if resp.status == 200:
                            latencies.append(time.perf_counter() - started)
                        else:
                            await asyncio.sleep(float(resp.headers.get("Retry-After", "0.01")))
                except (aiohttp.ClientError, OSError):
                    await asyncio.sleep(0.01)

    await asyncio.gather(*(one(i) for i in range(PROBE_CONNECTIONS)))
    return latencies


async def _wrk(m: Measure, seconds: float = SECONDS) -> wrk.Result:
    return await wrk.run(m.url, connections=m.connections, seconds=seconds, script=m.script,
                         args=m.args())  # fmt: skip


async def measure(m: Measure, perf: bool) -> None:
    if m.baseline is not None:
        m.beside.append(await _wrk(m.baseline))
    pid = m.gateway.proc.pid if m.gateway is not None and m.gateway.proc else None
    run = _wrk(m)
    if pid is None:
        m.results.append(await run)
        _progress(m)
        return
    stop = asyncio.Event()
    async with fsyncs.counting(pid, perf and m.fsyncs_here) as count:
        cpu = cpu_seconds(pid)
        probing = asyncio.ensure_future(probe(m.probe, stop)) if m.probe else None
        result = await run
        used = cpu_seconds(pid) - cpu
        stop.set()
        if probing is not None:
            latencies = await probing
            if len(latencies) >= 2:
                m.probe_p99.append(statistics.quantiles(latencies, n=100)[98] * 1000)
    if m.connections > CONNECTIONS:
        # the flood's last admitted calls, still finishing, hold the limit's places: the next
        # measurement's first calls would be shed (seen: 3 of them, and a p99 of 474 ms)
        await asyncio.sleep(SETTLE_AFTER_FLOOD_S)
    m.results.append(result)
    m.cpu_us.append(used / max(result.requests, 1) * 1e6)
    m.rss_mib.append(memory_mib(pid))
    if count.value is not None:
        m.fsync_counts.append(count.value)
    _progress(m)


def _progress(m: Measure) -> None:
    r = m.results[-1]
    beside = f" (the peer just before: {m.beside[-1].rate:.0f}/s)" if m.beside else ""
    print(
        f"  {m.name}, {m.connections} conns: {r.rate:.0f}/s p50 {r.p50_ms:.2f} ms "
        f"p99 {r.p99_ms:.1f} ms, {r.errors} errors{beside}",
        file=sys.stderr,
        flush=True,
    )


def ratio(results: list[wrk.Result], against: list[wrk.Result]) -> str:
    """The median of per-round calls/s ratios."""
    if not against:
        return ""
    ratios = targets.ratios(_rounds(results).rates, _rounds(against).rates)
    return f"{statistics.median(ratios):.2f}"


def _rounds(results: list[wrk.Result]) -> targets.Rounds:
    return targets.Rounds(
        [r.rate for r in results], [r.p50_ms for r in results], [r.p99_ms for r in results]
    )


def cells(m: Measure, peer: Measure | None, ngx: Measure | None, note: str = "") -> list[str]:
    errors = sum(r.errors for r in m.results)
    notes = [note] if note else []
    if errors:
        notes.append(f"{errors} errors or non-2xx")
    cpu = f"{statistics.median(m.cpu_us):.0f}" if m.cpu_us else ""
    per_fsync = ""
    if m.fsync_counts and sum(m.fsync_counts):
        per_fsync = f"{sum(r.requests for r in m.results) / sum(m.fsync_counts):.1f}"
    return [
        m.name,
        str(m.connections),
        f"{m.median(lambda r: r.rate):.0f}",
        f"{m.median(lambda r: r.p50_ms):.2f}",
        f"{m.median(lambda r: r.p99_ms):.1f}",
        # a gateway row against the peer measured right before it; the baselines by round
        ratio(m.results, m.beside or (peer.results if peer else [])),
        ratio(m.results, ngx.results if ngx else []),
        cpu,
        per_fsync,
        "; ".join(notes),
    ]


HEAD = [
    "row",
    "conns",
    "calls/s",
    "p50 ms",
    "p99 ms",
    "× peer",
    "× nginx",
    "gateway CPU µs/call",
    "calls/fsync",
    "notes",
]


def table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(c) + " |" for c in rows]
    return "\n".join(lines)


async def memory_row(root: Path, policy: Path) -> tuple[list[str], tuple[float, float], float]:
    """MEMORY_CALLS fenced strict calls over MEMORY_RESOURCES resources on a fresh gateway whose
    retention keeps the database bounded: the row, RSS after each half, and the peak (MiB)."""
    async with gateway_process(root, "memory", policy, "strict") as gateway:
        assert gateway.proc is not None
        pid = gateway.proc.pid
        idle = memory_mib(pid)
        halves, rss = [], []
        for _ in range(2):
            args = (*fenced("/tool/act", "mem/", MEMORY_RESOURCES)()[:4], str(MEMORY_CALLS // 2))
            halves.append(
                await wrk.run(
                    gateway.url,
                    connections=CONNECTIONS,
                    seconds=3600,
                    script="fenced.lua",
                    args=args,
                )
            )
            rss.append(memory_mib(pid))
        peak = memory_mib(pid, "VmHWM")
        db = (
            sum(p.stat().st_size for p in (root / "memory").glob("bench.db*") if p.is_file())
            / 2**20
        )
    calls = sum(r.requests for r in halves)
    seconds = sum(r.seconds for r in halves)
    errors = sum(r.errors for r in halves)
    note = (
        f"RSS idle {idle:.0f} MiB, {rss[0]:.0f} after the first half, {rss[1]:.0f} after the "
        f"second; peak {peak:.0f} MiB; database {db:.0f} MiB at the end"
    )
    if errors:
        note += f"; {errors} errors or non-2xx"
    row = [
        f"memory: {calls:,} fenced calls (strict) over {MEMORY_RESOURCES:,} resources",
        str(CONNECTIONS),
        f"{calls / seconds:.0f}",
        f"{statistics.median(r.p50_ms for r in halves):.2f}",
        f"{max(r.p99_ms for r in halves):.1f}",
        "",
        "",
        "",
        "",
        note,
    ]
    return row, (rss[0], rss[1]), peak


def bench_policy(root: Path, upstream: str) -> Path:
    keep = {"retention_s": RETENTION_S}
    return write_policy(
        root / "policy.yaml",
        make_policy(
            upstream + "/api",
            [
                {"match": "par/*", "queue_timeout_s": 30, "idempotency": keep},
                {"match": "mem/*", "queue_timeout_s": 30, "idempotency": keep},
                {
                    "match": "ser/*",
                    "concurrency": "serial",
                    "queue_timeout_s": 60,
                    "idempotency": keep,
                },
                {
                    "match": "lease/*",
                    "lease": {"issuer": "gateway", "ttl_s": 3600, "max_ttl_s": 3600},
                    "queue_timeout_s": 30,
                    "idempotency": keep,
                },
            ],
            max_connections=64,
        ),
    )


async def run() -> str:
    started = time.monotonic()
    perf = fsyncs.available()
    with tempfile.TemporaryDirectory(prefix="fence-bench-") as tmp:
        root = Path(tmp)
        syncs = [fsyncs.fdatasync_ms(root)]
        store_ops = await fsyncs.store_operation_ms(root)
        async with contextlib.AsyncExitStack() as stack:
            upstream = await stack.enter_async_context(process("tests.bench.upstream"))
            peer = await stack.enter_async_context(process("tests.bench.peer", upstream))
            ngx = stack.enter_context(nginx(root / "nginx", int(upstream.rsplit(":", 1)[1])))
            policy = bench_policy(root, upstream)
            strict = await stack.enter_async_context(
                gateway_process(root, "strict", policy, "strict")
            )
            relaxed = await stack.enter_async_context(
                gateway_process(root, "relaxed", policy, "relaxed")
            )
            # every call traced and sampled (docs/contract.md §21); the spans go to the tool,
            # which takes any POST: the row shows what making and exporting them costs
            traced = await stack.enter_async_context(
                gateway_process(
                    root,
                    "traced",
                    policy,
                    "strict",
                    GATEWAY_OTEL="true",
                    OTEL_TRACES_SAMPLER="always_on",
                    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=upstream + "/v1/traces",
                )
            )
            session = await stack.enter_async_context(aiohttp.ClientSession())
            leases = await acquire_leases(session, strict.url)

            hot = fenced("/tool/act", "par/hot", 1)
            # the baselines: the same requests, to the tool directly, through the peer, nginx
            base: dict[str, dict[str, Measure]] = {}
            for kind, script, args, conns in (
                ("post", "fenced.lua", hot, CONNECTIONS),
                ("post1", "fenced.lua", hot, 1),
                ("get", "get.lua", tuple, CONNECTIONS),
            ):
                label = {
                    "post": "POST",
                    "post1": "POST, 1 connection",
                    "get": "GET",
                }[kind]
                base[kind] = {
                    "direct": Measure(f"tool directly: {label}", upstream + "/tool/act",
                                      conns, script, args),
                    "peer": Measure(f"peer (aiohttp proxy): {label}", peer + "/tool/act",
                                    conns, script, args),
                }  # fmt: skip
                if ngx is not None:
                    base[kind]["nginx"] = Measure(
                        f"nginx: {label}", ngx + "/tool/act", conns, script, args
                    )

            def gw(name: str, g: GatewayProcess, conns: int, script: str, args: Any) -> Measure:
                return Measure(name, g.url + "/tool/act", conns, script, args, g)

            # the rows the targets are judged on (tests/bench/targets.py), then the others
            hot32 = gw(
                "gateway: fenced POST, strict, 1 hot resource",
                strict,
                CONNECTIONS,
                "fenced.lua",
                hot,
            )
            one_conn = gw(
                "gateway: fenced POST, strict, 1 hot resource", strict, 1, "fenced.lua", hot
            )
            ten_thousand = gw(
                f"gateway: fenced POST, strict, {SPREAD_RESOURCES:,} resources",
                strict,
                CONNECTIONS,
                "fenced.lua",
                fenced("/tool/act", "par/r", SPREAD_RESOURCES),
            )
            serial_one = gw(
                "gateway: serial, strict, 1 resource",
                strict,
                CONNECTIONS,
                "fenced.lua",
                fenced("/tool/act", "ser/one", 1),
            )
            unfenced = gw("gateway: unfenced GET", strict, CONNECTIONS, "get.lua", tuple)
            gateway_rows: list[tuple[Measure, str]] = [
                (hot32, "post"),
                (one_conn, "post1"),
                (ten_thousand, "post"),
                (gw(f"gateway: fenced POST, strict, {LEASES} gateway-issued leases", strict,
                    CONNECTIONS, "fenced.lua", fenced("/tool/act", "lease/", LEASES, *leases)),
                 "post"),
                (gw(f"gateway: serial, strict, {SERIAL_RESOURCES} resources", strict,
                    CONNECTIONS, "fenced.lua", fenced("/tool/act", "ser/r", SERIAL_RESOURCES)),
                 "post"),
                (serial_one, "post"),
                (unfenced, "get"),
                (gw("gateway: fenced POST, relaxed, 1 hot resource", relaxed, CONNECTIONS,
                    "fenced.lua", hot), "post"),
                (gw("gateway: fenced POST, strict, 1 hot resource, GATEWAY_OTEL=true", traced,
                    CONNECTIONS, "fenced.lua", hot), "post"),
            ]  # fmt: skip
            overload = gw(
                f"gateway: fenced POST, strict, 1 hot resource, {OVERLOAD_CONNECTIONS} "
                "connections, GATEWAY_MAX_INFLIGHT=auto",
                strict,
                OVERLOAD_CONNECTIONS,
                "fenced.lua",
                hot,
            )
            overload.probe = strict.url + "/tool/act"
            pg_rows: list[Measure] = []
            pg_one, pg_workers = (stack.enter_context(postgres_database()) for _ in range(2))
            vacuumed: list[str] = []  # the databases the bench vacuums itself (`vacuum`)
            if pg_one and pg_workers:
                if await autovacuum_is_off():
                    vacuumed = [pg_one, pg_workers]
                one = await stack.enter_async_context(
                    gateway_process(root, "pg1", policy, "strict", GATEWAY_DATABASE_URL=pg_one)
                )
                two = await stack.enter_async_context(
                    gateway_process(
                        root,
                        "pgw",
                        policy,
                        "strict",
                        GATEWAY_DATABASE_URL=pg_workers,
                        GATEWAY_WORKERS="2",
                    )
                )
                spread = fenced("/tool/act", "par/r", 64)
                pg_rows = [
                    gw("gateway on PostgreSQL: fenced POST, 64 resources", one, CONNECTIONS,
                       "fenced.lua", spread),
                    gw("gateway on PostgreSQL, --workers 2: fenced POST, 64 resources", two,
                       CONNECTIONS, "fenced.lua", spread),
                ]  # fmt: skip
                pg_rows[0].fsyncs_here = pg_rows[1].fsyncs_here = False
                pg_rows[1].gateway = None  # its CPU is two processes'

            measures = [m for kinds in base.values() for m in kinds.values()]
            measures += [m for m, _ in gateway_rows] + [overload, *pg_rows]
            for m, kind in gateway_rows:
                m.baseline = base[kind]["peer"]
            overload.baseline = base["post"]["peer"]
            for m in pg_rows:
                m.baseline = base["post"]["peer"]
            for m in measures:  # warm-up: connections, caches, the adaptive limit
                await _wrk(m, seconds=1)
            for r in range(ROUNDS):
                await vacuum(vacuumed)
                shift = r * len(measures) // ROUNDS
                for m in measures[shift:] + measures[:shift]:
                    await measure(m, perf)
                print(f"round {r + 1}/{ROUNDS} done", file=sys.stderr, flush=True)

            rows = []
            for kind in base.values():
                rows += [cells(m, kind["peer"], kind.get("nginx")) for m in kind.values()]
            for m, kind in gateway_rows:
                note = ""
                if m.connections == 1:
                    added = statistics.median(
                        targets.differences(_rounds(m.results).p50s, _rounds(m.beside).p50s)
                    )
                    note = f"p50 {added:+.2f} ms over the peer's"
                rows.append(cells(m, base[kind]["peer"], base[kind].get("nginx"), note))
            shed = sum(r.non_2xx for r in overload.results)
            total = sum(r.requests for r in overload.results)
            admitted = [
                (r.requests - r.non_2xx) / r.seconds / h.rate
                for r, h in zip(overload.results, hot32.results, strict=True)
            ]
            p99_ratio = [
                p / h.p99_ms for p, h in zip(overload.probe_p99, hot32.results, strict=False)
            ]
            note = (
                f"admitted calls/s {statistics.median(admitted):.2f}× the 32-connection row; "
                f"{shed / max(total, 1):.0%} shed (503 overloaded); admitted p99 "
                f"{statistics.median(overload.probe_p99) if overload.probe_p99 else 0:.1f} ms "
                f"({statistics.median(p99_ratio) if p99_ratio else 0:.1f}× the 32-connection "
                f"p99), from a probe of {PROBE_CONNECTIONS} connections; "
                f"RSS {max(overload.rss_mib):.0f} MiB"
            )
            overload_cells = cells(overload, base["post"]["peer"], base["post"].get("nginx"))
            overload_cells[-1] = note  # every 503 counts as non-2xx in wrk: said above
            rows.append(overload_cells)
            pg_note = "autovacuum is off: VACUUM ANALYZE before each round" if vacuumed else ""
            rows += [
                cells(m, base["post"]["peer"], base["post"].get("nginx"), pg_note) for m in pg_rows
            ]
            memory, memory_halves, memory_peak = await memory_row(root, policy)
            rows.append(memory)
            syncs.append(fsyncs.fdatasync_ms(root))
            judged = targets.judge(
                targets.Run(
                    fdatasync_ms=syncs[0][0],
                    hot=_rounds(hot32.results),
                    hot_peer=_rounds(hot32.beside),
                    one=_rounds(one_conn.results),
                    one_peer=_rounds(one_conn.beside),
                    get=_rounds(unfenced.results),
                    get_peer=_rounds(unfenced.beside),
                    spread=_rounds(ten_thousand.results),
                    serial=_rounds(serial_one.results),
                    peer_one=_rounds(base["post1"]["peer"].results),
                    flood_admitted=admitted,
                    flood_p99=p99_ratio,
                    flood_rss_mib=max(overload.rss_mib),
                    memory_calls=MEMORY_CALLS,
                    memory_halves_mib=memory_halves,
                    memory_peak_mib=memory_peak,
                    postgres=_rounds(pg_rows[0].results) if pg_rows else None,
                )
            )
            cost_rows = await costs.table(upstream) if COSTS and costs.available() else None

    fsync_note = (
        "calls/fsync: fsync + fdatasync system calls of the gateway process, counted by `perf stat`"
        if perf
        else "calls/fsync: not measured (perf missing or not permitted)"
    )
    sync_note = (
        "fdatasync of a 4 KiB write on the databases' filesystem, before the rounds and after: "
        + "; ".join(f"median {m:.2f} ms, p99 {p:.2f} ms" for m, p in syncs)
        + ". A store operation on the same filesystem, one call at a time as at one connection "
        "(tests/bench/fsyncs.py: the gateway's SQLite store, its statements and COMMIT): an "
        f"admission {store_ops[0]:.2f} ms and an outcome {store_ops[1]:.2f} ms at the median, "
        f"together {sum(store_ops):.2f} ms, where the one-connection target allows "
        f"{targets.one_connection_allowance_ms(syncs[0][0]):.2f} ms for all a call adds"
    )
    if cost_rows is None:
        cost_table = "Cost table: not measured (valgrind missing, or BENCH_COSTS=0)."
    else:
        cost_table = "\n".join(
            [
                f"Instructions per fenced call (strict, JSON log lines), by part: callgrind, "
                f"{costs.CALLS} calls (tests/bench/costs.py)",
                "",
                "| part | k instructions/call | share |",
                "|---|---|---|",
                *("| " + " | ".join(row) + " |" for row in cost_rows),
            ]
        )
    return "\n".join(
        [
            f"## fence-gateway bench, {time.strftime('%Y-%m-%d %H:%M')}",
            "",
            f"{platform.machine()}, {os.cpu_count()} CPUs shared by wrk, the tool, the proxies "
            f"and the gateway; Python {platform.python_version()}; {_loop()}; "
            f"{ROUNDS} rounds of {SECONDS:g} s per measurement, alternating; medians over "
            "rounds. × peer: the median of per-round calls/s ratios to the same request through "
            "the peer (a bare aiohttp proxy on uvloop), measured right before each gateway "
            "row; × nginx: the same, to the round's nginx row.",
            "",
            table(rows),
            "",
            f"{fsync_note}. Gateway CPU: user + system time of the gateway process per call. "
            f"Run took {time.monotonic() - started:.0f} s.",
            "",
            sync_note + ".",
            "",
            "Against the targets (docs/design/performance.md), each judged on the median of its "
            "per-round values:",
            "",
            targets.table(judged),
            "",
            cost_table,
        ]
    )


def _loop() -> str:
    try:
        import uvloop
    except ImportError:
        return "the gateway on asyncio's loop (uvloop not installed)"
    return f"the gateway and the peer on uvloop {uvloop.__version__}"


def main() -> None:
    try:
        report = asyncio.run(run())
    except KeyboardInterrupt:  # every process and database was already stopped and dropped
        sys.exit("make bench: interrupted")
    print(report)
    out = REPO_ROOT / "var" / "bench.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(report + "\n")


if __name__ == "__main__":
    main()
