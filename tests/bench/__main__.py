"""`make bench`: one table of what the gateway costs, every row measured in the same run.

A real tool (tests/bench/upstream.py) and real gateways (`python -m gateway serve`, each with
its own SQLite file: strict, relaxed, and strict on a store already holding a week of receipts;
and, when PostgreSQL answers at 127.0.0.1:5432, one replica, two replicas and `--workers 2`
on a fresh PostgreSQL database each) run as subprocesses on 127.0.0.1; this process only
drives load with a fixed number of concurrent aiohttp workers. The machines are shared and
noisy, so every round runs every scenario back to back (in a rotating order), each row
reports medians over the rounds, and "× direct" is the median of the per-round ratios to the
direct call, which cancels most of the drift. The memory row runs last, on a fresh gateway.
The table is printed and written to var/bench.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tests.bench import fsyncs, prefill
from tests.harness import REPO_ROOT, GatewayProcess, make_policy, write_policy
from tests.pg import drop_database, run_sync, server_sql, url_of

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
WORKERS = 64
CALLS = 1280  # per scenario and round: 20 calls for each of the 64 workers
SERIAL_CALLS = 512  # one resource, one call at a time: slower, so fewer
SINGLE_CALLS = 200  # the concurrency-1 row
WARMUP_CALLS = 256
MEMORY_RESOURCES = 10_000
AGED_RECEIPTS = 300_000  # 7 days of retention at one call every two seconds
AGED_CALLS = 2560  # resumed from SIGSTOP, its overdue sweep runs within each sample

Request = tuple[str, str, dict[str, str], bytes | None]  # method, url, headers, body


@dataclass
class Sample:
    calls: int
    seconds: float
    latencies: list[float]
    errors: int
    cpu_s: float | None = None  # the gateway's user + system CPU time during the sample
    fsyncs: int | None = None

    @property
    def rate(self) -> float:
        return self.calls / self.seconds

    def quantile_ms(self, q: int) -> float:
        return statistics.quantiles(self.latencies, n=100)[q - 1] * 1000


@dataclass
class Scenario:
    name: str
    request: Callable[[int], Request]
    gateway: GatewayProcess | None = None
    calls: int = CALLS
    workers: int = WORKERS
    paused: bool = False  # SIGSTOP between samples: its idle work would slow the other rows
    fsyncs_here: bool = True  # False: the store's fsyncs are the database server's
    samples: list[Sample] = field(default_factory=list)


_serial = itertools.count()


async def drive(
    session: aiohttp.ClientSession, request: Callable[[int], Request], calls: int, workers: int
) -> Sample:
    """`calls` requests from `workers` concurrent workers; each request gets a unique number."""
    latencies: list[float] = []
    errors = 0
    issued = itertools.count()

    async def worker() -> None:
        nonlocal errors
        while next(issued) < calls:
            method, url, headers, body = request(next(_serial))
            started = time.perf_counter()
            try:
                async with session.request(method, url, headers=headers, data=body) as resp:
                    await resp.read()
                    errors += resp.status != 200
            except (aiohttp.ClientError, OSError):
                errors += 1
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return Sample(calls, time.perf_counter() - started, latencies, errors)


def plain_get(url: str) -> Callable[[int], Request]:
    return lambda n: ("GET", url, {}, None)


def fenced_post(url: str, resource: Callable[[int], str]) -> Callable[[int], Request]:
    """A fenced call with a body of its own, so its derived idempotency key is new (no replay).

    Fence 1 on every call: with an external issuer an equal fence is accepted, so no call is
    stale and none waits for an older one.
    """

    def request(n: int) -> Request:
        headers = {
            "X-Lease-Resource": resource(n),
            "X-Fence-Token": "1",
            "Content-Type": "application/json",
        }
        return "POST", f"{url}/tool/act", headers, b'{"n": %d}' % n

    return request


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (/proc/PID/stat fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@contextlib.asynccontextmanager
async def upstream_process():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.bench.upstream", cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE
    )
    try:
        port = int(await asyncio.wait_for(proc.stdout.readline(), 15))
        yield f"http://127.0.0.1:{port}"
    finally:
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
            **env,
        },
    )
    await gateway.start()
    try:
        yield gateway
    finally:
        if gateway.proc.poll() is None:  # a paused gateway would not hear SIGTERM
            os.kill(gateway.proc.pid, signal.SIGCONT)
        await gateway.terminate()


@contextlib.contextmanager
def postgres_database() -> Iterator[str | None]:
    """A fresh PostgreSQL database's URL, dropped afterwards; None when none answers."""
    name = f"fg_bench_{os.getpid()}_{next(_databases)}"
    try:
        run_sync(server_sql, f"CREATE DATABASE {name}")
    except (OSError, TimeoutError):
        yield None
        return
    try:
        yield url_of(name)
    finally:
        drop_database(name)


_databases = itertools.count()


def alternating(*requests: Callable[[int], Request]) -> Callable[[int], Request]:
    """Spread calls over replicas, as a load balancer with no affinity would."""
    return lambda n: requests[n % len(requests)](n)


async def measure(session: aiohttp.ClientSession, scenario: Scenario, perf: bool) -> Sample:
    if scenario.gateway is None:
        return await drive(session, scenario.request, scenario.calls, scenario.workers)
    pid = scenario.gateway.proc.pid
    if scenario.paused:
        os.kill(pid, signal.SIGCONT)
    try:
        async with fsyncs.counting(pid, perf) as count:
            cpu = cpu_seconds(pid)
            sample = await drive(session, scenario.request, scenario.calls, scenario.workers)
            sample.cpu_s = cpu_seconds(pid) - cpu
    finally:
        if scenario.paused:
            os.kill(pid, signal.SIGSTOP)
    sample.fsyncs = count.value
    return sample


async def memory_row(session: aiohttp.ClientSession, root: Path, policy: Path) -> list[str]:
    """RSS idle, after 10,000 fenced calls on 10,000 resources, and after 10,000 more.

    The first 10,000 also fill allocator pools and SQLite's page cache (bounded); the second
    batch is the leak test: memory kept per resource (lanes never freed, say) grows it again.
    """
    async with gateway_process(root, "memory", policy, "strict") as gateway:
        pid = gateway.proc.pid
        idle = rss_mib(pid)
        first = await drive(
            session, fenced_post(gateway.url, lambda n: f"mem/{n}"), MEMORY_RESOURCES, WORKERS
        )
        after = rss_mib(pid)
        second = await drive(
            session, fenced_post(gateway.url, lambda n: f"mem/{n}"), MEMORY_RESOURCES, WORKERS
        )
        more = rss_mib(pid)
    per_resource = (more - after) * 1024 * 1024 / MEMORY_RESOURCES
    note = (
        f"RSS idle {idle:.1f} MiB → {after:.1f} after 10k resources → {more:.1f} after "
        f"10k more ({per_resource:+.0f} B/resource)"
    )
    errors = first.errors + second.errors
    if errors:
        note += f"; {errors} errors"
    return [
        "memory: fenced POST, strict, one new resource per call",
        str(WORKERS),
        f"{MEMORY_RESOURCES}",
        f"{first.rate:.0f}",
        f"{first.quantile_ms(50):.1f}",
        f"{first.quantile_ms(99):.1f}",
        "",
        "",
        "",
        note,
    ]


def row(scenario: Scenario, baseline: Scenario) -> list[str]:
    samples = scenario.samples
    ratios = [s.rate / b.rate for s, b in zip(samples, baseline.samples, strict=True)]
    calls = sum(s.calls for s in samples)
    cpu = [s.cpu_s for s in samples if s.cpu_s is not None]
    synced = [s.fsyncs for s in samples if s.fsyncs is not None]
    per_fsync = ""
    if not scenario.fsyncs_here:
        per_fsync = "in PostgreSQL"
    elif synced and scenario.gateway is not None:
        per_fsync = f"{calls / sum(synced):.1f}" if sum(synced) else "no fsync"
    errors = sum(s.errors for s in samples)
    return [
        scenario.name,
        str(scenario.workers),
        str(scenario.calls),
        f"{statistics.median(s.rate for s in samples):.0f}",
        f"{statistics.median(s.quantile_ms(50) for s in samples):.1f}",
        f"{statistics.median(s.quantile_ms(99) for s in samples):.1f}",
        f"{statistics.median(ratios):.2f}",
        f"{sum(cpu) / calls * 1e6:.0f}" if cpu else "",
        per_fsync,
        f"{errors} errors" if errors else "",
    ]


def table(rows: list[list[str]]) -> str:
    head = [
        "scenario",
        "workers",
        "calls/round",
        "calls/s",
        "p50 ms",
        "p99 ms",
        "× direct",
        "gateway CPU µs/call",
        "calls/fsync",
        "notes",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def postgres_scenarios(
    one: GatewayProcess, pair: list[GatewayProcess], workers: GatewayProcess
) -> list[Scenario]:
    """The same fenced POST as the SQLite strict row, on PostgreSQL (strict: the server's
    synchronous_commit). Two replicas: calls alternate between them; `--workers 2`: one port.
    Gateway CPU is one process's, so it is left out where there are two."""

    def spread(n: int) -> str:
        return f"par/r{n % 64}"

    return [
        Scenario(
            "fenced POST, PostgreSQL, 1 replica",
            fenced_post(one.url, spread),
            one,
            fsyncs_here=False,
        ),
        Scenario(
            "fenced POST, PostgreSQL, 2 replicas",
            alternating(*(fenced_post(g.url, spread) for g in pair)),
        ),
        Scenario("fenced POST, PostgreSQL, --workers 2", fenced_post(workers.url, spread)),
        Scenario(
            "fenced POST, PostgreSQL, 2 replicas, serial, 1 resource",
            alternating(*(fenced_post(g.url, lambda n: "ser/one") for g in pair)),
            calls=SERIAL_CALLS,
        ),
    ]


def scenarios(
    upstream: str, strict: GatewayProcess, relaxed: GatewayProcess, aged: GatewayProcess
) -> list[Scenario]:
    """The rows, baseline first; the concurrency-1 row pairs with the third for group commit."""

    def spread(n: int) -> str:
        return f"par/r{n % 64}"

    return [
        Scenario("direct to upstream (baseline)", plain_get(upstream + "/api/x")),
        Scenario("gateway, unfenced GET", plain_get(strict.url + "/tool/x"), strict),
        Scenario(
            "fenced POST, strict, parallel, 64 resources", fenced_post(strict.url, spread), strict
        ),
        Scenario(
            "fenced POST, relaxed, parallel, 64 resources",
            fenced_post(relaxed.url, spread),
            relaxed,
        ),
        Scenario(
            "fenced POST, strict, serial, 1 resource",
            fenced_post(strict.url, lambda n: "ser/one"),
            strict,
            calls=SERIAL_CALLS,
        ),
        Scenario(
            "fenced POST, strict, parallel, 1 worker",
            fenced_post(strict.url, spread),
            strict,
            calls=SINGLE_CALLS,
            workers=1,
        ),
        Scenario(
            f"fenced POST, strict, 64 resources, store holding {AGED_RECEIPTS // 1000}k receipts",
            fenced_post(aged.url, spread),
            aged,
            calls=AGED_CALLS,
            paused=True,
        ),
    ]


async def run() -> str:
    started = time.monotonic()
    perf = fsyncs.available()
    with tempfile.TemporaryDirectory(prefix="fence-bench-") as tmp:
        root = Path(tmp)
        async with contextlib.AsyncExitStack() as stack:
            upstream = await stack.enter_async_context(upstream_process())
            policy = write_policy(
                root / "policy.yaml",
                make_policy(
                    upstream + "/api",
                    [
                        {"match": "par/*", "queue_timeout_s": 30},
                        {"match": "ser/*", "concurrency": "serial", "queue_timeout_s": 60},
                        {"match": "mem/*", "queue_timeout_s": 30},
                    ],
                    max_connections=WORKERS,
                ),
            )
            (root / "aged").mkdir()
            prefill.completed_receipts(root / "aged" / "bench.db", AGED_RECEIPTS)
            gateways = [
                await stack.enter_async_context(gateway_process(root, name, policy, d))
                for name, d in (("strict", "strict"), ("relaxed", "relaxed"), ("aged", "strict"))
            ]
            session = await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=WORKERS))
            )

            rows = scenarios(upstream, *gateways)
            urls = [stack.enter_context(postgres_database()) for _ in range(3)]
            if all(urls):
                one = await stack.enter_async_context(
                    gateway_process(root, "pg1", policy, "strict", GATEWAY_DATABASE_URL=urls[0])
                )
                pair = [
                    await stack.enter_async_context(
                        gateway_process(
                            root, f"pg2{i}", policy, "strict", GATEWAY_DATABASE_URL=urls[1]
                        )
                    )
                    for i in range(2)
                ]
                workers = await stack.enter_async_context(
                    gateway_process(
                        root,
                        "pgw",
                        policy,
                        "strict",
                        GATEWAY_DATABASE_URL=urls[2],
                        GATEWAY_WORKERS="2",
                    )
                )
                rows += postgres_scenarios(one, pair, workers)
            for scenario in rows:
                await drive(session, scenario.request, WARMUP_CALLS, scenario.workers)
                if scenario.paused:
                    os.kill(scenario.gateway.proc.pid, signal.SIGSTOP)
            for r in range(ROUNDS):
                for scenario in rows[r:] + rows[:r]:
                    scenario.samples.append(await measure(session, scenario, perf))
                print(f"round {r + 1}/{ROUNDS} done", file=sys.stderr, flush=True)

            cells = [row(s, rows[0]) for s in rows]
            many, one = rows[2].samples, rows[5].samples
            speedup = statistics.median(m.rate / o.rate for m, o in zip(many, one, strict=True))
            cells[5][-1] = (
                f"group commit: 64 workers get {speedup:.1f}× the calls/s of 1 {cells[5][-1]}"
            ).strip()
            cells.append(await memory_row(session, root, policy))

    fsync_note = (
        "calls/fsync: fsync + fdatasync system calls of the gateway process, counted by `perf stat`"
        if perf
        else "calls/fsync: not measured (perf missing or not permitted)"
    )
    return "\n".join(
        [
            f"## fence-gateway bench, {time.strftime('%Y-%m-%d %H:%M')}",
            "",
            f"Python {platform.python_version()}, {os.cpu_count()} CPUs shared by the load "
            f"generator, the upstream and the gateway; {ROUNDS} rounds; medians over rounds; "
            "× direct is the median of the per-round calls/s ratios to the direct call. "
            "Every call answered 200 unless noted.",
            "",
            table(cells),
            "",
            f"{fsync_note}. Gateway CPU: user + system time of the gateway process per call. "
            f"Run took {time.monotonic() - started:.0f}s.",
        ]
    )


def main() -> None:
    report = asyncio.run(run())
    print(report)
    out = REPO_ROOT / "var" / "bench.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(report + "\n")


if __name__ == "__main__":
    main()
