"""One soak: real gateway processes on one store, concurrent clients, a nemesis, a recording
tool, and the history checker's verdict.

    report = await soak(SoakConfig(store="sqlite", duration_s=10, workdir=tmp_path))
    assert report.violations == [], report.text()

SQLite runs one gateway process (one process per database file); PostgreSQL runs two
replicas on a database of its own, each attacked by the nemesis. The tool is a
`RecordingUpstream` in this process, so it lives through every gateway kill and its arrival
times share the clients' clock. After the run the nemesis stops with the cluster whole, the
clients finish, recovery is given its time (every `pending` receipt must have been settled by
then), and the receipts are read back through the store API.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from tests.harness import (
    Behavior,
    GatewayProcess,
    Recorded,
    RecordingUpstream,
    free_port,
    make_policy,
    write_policy,
)
from tests.pg import create_database, drop_database, url_of
from tests.soak.history import Receipt, SideEffect, Violation, check, summary
from tests.soak.nemesis import ACTIONS, Action, Cluster, restart, run_nemesis
from tests.soak.workload import Workload

STORES = ("sqlite", "postgresql", "patroni")
"""`patroni`: two replicas on a Patroni cluster of three nodes under synchronous replication
(GATEWAY_REPLICATION=sync), whose primary the nemesis also fails over (tests.ha.cluster)."""


def available_stores() -> tuple[str, ...]:
    """The stores this machine can soak: `patroni` needs Patroni and etcd installed."""
    from tests.ha.cluster import available

    return STORES if available() else STORES[:2]


SWEEP_S = 0.2  # a PostgreSQL instance's heartbeat lease is three of these
UPSTREAM_TIMEOUT_S = 3.0
RECONCILE_GRACE_S = 0.5
# Every `pending` receipt is settled within this after the clients stop: a call's own
# timeout, or the sweeper's rule (timeout + grace), or a silent instance's three sweeps.
SETTLE_S = UPSTREAM_TIMEOUT_S + RECONCILE_GRACE_S + 10 * SWEEP_S + 5.0


@dataclasses.dataclass
class SoakConfig:
    store: str  # "sqlite" or "postgresql"
    duration_s: float
    workdir: Path
    clients: int = 8
    seed: int = 1
    lease_ttl_s: float = 1.0
    durability: str = "strict"  # GATEWAY_DURABILITY; both claim to survive a process crash
    actions: Sequence[Action] = ACTIONS
    # quiet seconds before each fault: the short form packs a round into a few seconds
    nemesis_gap_s: tuple[float, float] = (1.0, 4.0)


@dataclasses.dataclass
class SoakReport:
    store: str
    durability: str
    duration_s: float
    counts: dict[str, int]
    violations: list[Violation]

    def text(self, *, shown: int = 20) -> str:
        lines = [f"soak on {self.store} ({self.durability}), {self.duration_s:.0f} s:"]
        lines += [f"  {name}: {value}" for name, value in self.counts.items()]
        lines.append(f"  violations: {len(self.violations)}")
        lines += [f"    {name}: {n}" for name, n in summary(self.violations).items()]
        lines += [f"  ! {violation}" for violation in self.violations[:shown]]
        if len(self.violations) > shown:
            lines.append(f"  ! … and {len(self.violations) - shown} more")
        return "\n".join(lines)


def policy(upstream_url: str, lease_ttl_s: float) -> dict[str, Any]:
    return make_policy(
        upstream_url,
        [
            {
                "match": "lease/*",
                "lease": {"issuer": "gateway", "ttl_s": lease_ttl_s, "max_ttl_s": 60},
                "queue_timeout_s": 5,
            },
            {"match": "ext/*", "lease": {"issuer": "external"}, "queue_timeout_s": 5},
            {
                "match": "serial/*",
                "lease": {"issuer": "external"},
                "concurrency": "serial",
                "queue_timeout_s": 5,
            },
        ],
        timeout_s=UPSTREAM_TIMEOUT_S,
    )


def tool_behavior(rng: random.Random) -> Any:
    """Mostly quick answers, some slow ones, so takeovers meet calls still in flight."""

    def behave(_: Recorded) -> Behavior:
        slow = rng.random() < 0.1
        return Behavior(delay=rng.uniform(0.1, 0.5) if slow else rng.uniform(0.0, 0.03))

    return behave


async def soak(config: SoakConfig) -> SoakReport:
    if config.store not in STORES:
        raise ValueError(f"store: one of {STORES}, not {config.store!r}")
    rng = random.Random(config.seed)
    ha = _patroni() if config.store == "patroni" else None
    database = create_database() if config.store == "postgresql" else None
    if ha is not None:
        database = "fg_soak"
        ha.create_database(database)
    try:
        async with RecordingUpstream() as upstream:
            upstream.default = tool_behavior(random.Random(rng.random()))
            cluster = _cluster(config, upstream, database, ha)
            try:
                await asyncio.gather(*(gateway.start() for gateway in cluster.gateways))
                return await _run(config, cluster, upstream, rng)
            finally:
                for gateway in cluster.gateways:
                    gateway.kill9_sync()
    finally:
        if ha is not None:
            ha.close()
        elif database is not None:
            drop_database(database)


def _patroni() -> Any:
    from tests.ha.cluster import Cluster as Patroni
    from tests.ha.cluster import make_root

    ha = Patroni(make_root(), size=3, synchronous=True)
    try:
        ha.start()
    except BaseException:
        ha.close()
        raise
    return ha


def _cluster(
    config: SoakConfig, upstream: RecordingUpstream, database: str | None, ha: Any = None
) -> Cluster:
    policy_path = write_policy(
        config.workdir / "policies.yaml", policy(upstream.url, config.lease_ttl_s)
    )
    env = {
        "GATEWAY_RECONCILE_GRACE_S": str(RECONCILE_GRACE_S),
        "GATEWAY_DURABILITY": config.durability,
        "GATEWAY_LOG_LEVEL": "WARNING",  # hours of soak must not fill the disk with call logs
    }
    count = 1 if database is None else 2
    names = [f"soak-replica-{i}" for i in range(count)]
    gateways = []
    for i in range(count):
        workdir = config.workdir / f"gateway-{i}"
        workdir.mkdir(parents=True, exist_ok=True)
        extra = dict(env)
        if database is not None:
            # the connections carry the replica's name, so the nemesis can cut just its own
            url = url_of(database) if ha is None else ha.url(database)
            extra["GATEWAY_DATABASE_URL"] = f"{url}?application_name={names[i]}"
            extra["GATEWAY_INSTANCE_ID"] = f"replica-{i}"
            if ha is not None:
                extra["GATEWAY_REPLICATION"] = "sync"
        gateways.append(
            GatewayProcess(
                workdir, policy_path, sweep_interval_s=SWEEP_S, extra_env=extra, port=free_port()
            )
        )
    return Cluster(
        gateways,
        config.lease_ttl_s,
        database,
        names if database else [],
        calls_in_flight=lambda: sum(upstream.inflight.values()),
        ha=ha,
    )


async def _run(
    config: SoakConfig, cluster: Cluster, upstream: RecordingUpstream, rng: random.Random
) -> SoakReport:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # a fenced call is sent once; the clients decide about retries themselves
        session._retry_connection = False
        stop, calm = asyncio.Event(), asyncio.Event()
        workload = Workload(cluster.gateways, session, config.lease_ttl_s, stop)
        faults: Counter[str] = Counter()
        started = time.monotonic()
        clients = [
            asyncio.create_task(workload.client(random.Random(rng.random())))
            for _ in range(config.clients)
        ]
        nemesis = asyncio.create_task(
            run_nemesis(
                cluster,
                calm,
                random.Random(rng.random()),
                faults,
                actions=config.actions,
                gap_s=config.nemesis_gap_s,
            )
        )
        try:
            await asyncio.sleep(config.duration_s)
        finally:
            calm.set()
            try:
                await nemesis  # its last round played out: the cluster is whole again
            finally:
                stop.set()
                await asyncio.gather(*clients)
        elapsed = time.monotonic() - started
        for gateway in cluster.gateways:
            if gateway.returncode is not None:  # died by itself: a finding, but read on
                workload.counts["gateways found dead"] += 1
                await restart(gateway)
        receipts = await _settled_receipts(session, cluster.gateways[0].url)

    effects = [_side_effect(r) for r in upstream.requests]
    violations = check(workload.attempts, effects, receipts)
    counts: dict[str, int] = {
        "clients": config.clients,
        "calls": len(workload.attempts),
        "side effects": len(effects),
        "receipts": len(receipts),
        **{name: faults[name] for name in sorted(faults)},
        **{name: workload.counts[name] for name in sorted(workload.counts)},
        **{
            f"receipts {status}": n
            for status, n in sorted(Counter(r.status for r in receipts).items())
        },
    }
    return SoakReport(config.store, config.durability, elapsed, counts, violations)


async def _settled_receipts(session: aiohttp.ClientSession, url: str) -> list[Receipt]:
    """Every receipt, once none is `pending` any more or the settling time is over (then the
    checker reports those still pending)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        if not await _receipts(session, url, status="pending"):
            break
        await asyncio.sleep(SWEEP_S)
    return [Receipt.from_api(doc) for doc in await _receipts(session, url)]


async def _receipts(session: aiohttp.ClientSession, url: str, **filters: str) -> list[Any]:
    items: list[Any] = []
    params = {"limit": "1000", **filters}
    while True:
        async with session.get(f"{url}/_gateway/v1/receipts", params=params) as resp:
            page = await resp.json()
            if resp.status != 200:
                raise AssertionError(f"receipts list answered {resp.status}: {page}")
        items.extend(page["items"])
        if not page.get("next_cursor"):
            return items
        params["cursor"] = page["next_cursor"]


def _side_effect(request: Recorded) -> SideEffect:
    return SideEffect(
        seq=request.seq,
        arrived=request.received_at,
        resource=request.resource,
        fence=request.fence,
        receipt_id=request.headers.get("X-Receipt-Id"),
        request_id=request.headers.get("X-Request-Id"),
        key=request.headers.get("Idempotency-Key"),
    )
