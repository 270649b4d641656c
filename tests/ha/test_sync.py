"""`GATEWAY_REPLICATION=sync` on a real Patroni cluster under `synchronous_mode_strict`
(docs/contract.md §19): nothing is lost and nothing put on hold by a switchover or a kill -9
of the primary, and no call is forwarded that was admitted without synchronous replication.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest

from gateway.store.postgres import PostgresStartupError, PostgresStore
from tests.ha.cluster import Cluster
from tests.ha.test_async_failover import (
    acquire,
    epochs_recorded,
    fenced,
    policy,
    replicas,
    until_answered,
)
from tests.harness import (
    GatewayFactory,
    GatewayProcess,
    GatewayStartError,
    RecordingUpstream,
    fetch_receipts,
    problem_summary,
    wait_for,
)
from tests.pg import create_database, drop_database, url_of

SYNC = {"GATEWAY_REPLICATION": "sync", "GATEWAY_SYNC_WAIT_S": "1"}


@pytest.fixture
def database(sync_cluster: Cluster) -> Iterator[str]:
    name = f"fg_ha_{secrets.token_hex(4)}"
    sync_cluster.create_database(name)
    yield name
    sync_cluster.drop_database(name)


class TestRefusedAtStart:
    async def test_sync_on_a_server_without_a_synchronous_standby_exits_2(
        self, gateway_factory: GatewayFactory, upstream: RecordingUpstream
    ) -> None:
        name = create_database()  # the machine's PostgreSQL: no standby at all
        try:
            with pytest.raises(GatewayStartError) as failed:
                await gateway_factory(
                    policy(upstream), extra_env={"GATEWAY_DATABASE_URL": url_of(name), **SYNC}
                )
        finally:
            drop_database(name)
        assert "exited with 2" in str(failed.value)
        assert "synchronous_standby_names is empty" in str(failed.value)

    async def test_sync_with_relaxed_durability_exits_2(
        self, gateway_factory: GatewayFactory, upstream: RecordingUpstream
    ) -> None:
        with pytest.raises(GatewayStartError) as failed:
            await gateway_factory(
                policy(upstream),
                extra_env={
                    "GATEWAY_DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/none",
                    "GATEWAY_DURABILITY": "relaxed",
                    **SYNC,
                },
            )
        assert "exited with 2" in str(failed.value)
        assert "sync needs durability strict" in str(failed.value)


class TestSyncChecks:
    async def test_without_synchronous_replication_nothing_admitted_is_forwarded(
        self,
        sync_cluster: Cluster,
        database: str,
        gateway_factory: GatewayFactory,
        upstream: RecordingUpstream,
        session: aiohttp.ClientSession,
    ) -> None:
        a, b = await replicas(gateway_factory, upstream, sync_cluster.url(database), **SYNC)
        fences = itertools.count(1)
        assert (await fenced(session, a, "deploy/web", next(fences), "first")).status == 200
        sync_cluster.set_config(synchronous_mode=False)  # the standby names emptied, reloaded
        try:
            sync_cluster.wait_sync_standby(present=False)
            seen = len(upstream.requests)
            for gateway in (a, b, a, b):
                refused = await fenced(session, gateway, "deploy/web", next(fences), "none")
                assert problem_summary(refused) == (503, "store_unavailable"), refused.body
            assert len(upstream.requests) == seen
            async with session.get(f"{b.url}/_gateway/readyz") as resp:
                assert resp.status == 503
            await wait_for(lambda: "replication_not_synchronous" in a.stderr_text())
        finally:
            sync_cluster.set_config(synchronous_mode=True)
        sync_cluster.wait_sync_standby(present=True)
        resumed = await until_answered(
            lambda: fenced(session, b, "deploy/web", next(fences), "back")
        )
        assert resumed.status == 200, resumed.body
        await wait_for(lambda: "replication_synchronous" in a.stderr_text())

    async def test_a_commit_that_waits_too_long_for_the_standby_is_never_forwarded(
        self,
        sync_cluster: Cluster,
        database: str,
        gateway_factory: GatewayFactory,
        upstream: RecordingUpstream,
        session: aiohttp.ClientSession,
    ) -> None:
        a, _b = await replicas(gateway_factory, upstream, sync_cluster.url(database), **SYNC)
        assert (await fenced(session, a, "deploy/web", 1, "one")).status == 200
        seen = len(upstream.requests)
        with sync_cluster.lagging(sync_cluster.sync_standby()):
            began = time.monotonic()
            stuck = await fenced(session, a, "deploy/web", 2, "two")
            waited = time.monotonic() - began
        assert problem_summary(stuck) == (503, "store_unavailable"), stuck.body
        assert 1 <= waited < 10
        assert len(upstream.requests) == seen

        # The admission committed on the primary all the same: its receipt ends not_sent.
        async def settled() -> bool:
            found = await fetch_receipts(session, a.url, resource="deploy/web")
            return [(r["fence"], r["status"], r["error"]) for r in found if r["fence"] == 2] == [
                (2, "not_sent", "replication_wait")
            ]

        await wait_for(settled, timeout=30)
        # (its heartbeat waited for the standby too: the replica may have lapsed meanwhile)
        again = await until_answered(lambda: fenced(session, a, "deploy/web", 3, "three"))
        assert again.status == 200, again.body


class TestOneMode:
    async def test_a_replica_in_the_other_mode_exits_2_unless_none_other_is_alive(
        self, sync_cluster: Cluster, database: str
    ) -> None:
        url = sync_cluster.url(database)
        serving = PostgresStore(
            url, instance="sync-1", heartbeat_interval_s=0.3, replication="sync"
        )
        await serving.open()
        try:
            other = PostgresStore(url, instance="async-1", heartbeat_interval_s=0.3)
            with pytest.raises(PostgresStartupError, match="served in sync by 1 live instance"):
                await other.open()
        finally:
            await serving.close()
        await asyncio.sleep(1.0)  # three heartbeat intervals: sync-1 is no longer alive
        alone = PostgresStore(url, instance="async-2", heartbeat_interval_s=0.3)
        await alone.open()  # its mode is recorded, and counts from the next epoch on
        await alone.close()
        primary = sync_cluster.wait_primary()
        rows = sync_cluster.sql(primary, "SELECT mode FROM store_epochs", database)
        assert rows == [["async"]]


@dataclass
class Load:
    """Workers calling their own resources with ever higher fences through both replicas."""

    answered: list[tuple[float, str, int, int | None, str | None]] = field(default_factory=list)
    stop: bool = False


async def worker(
    load: Load, session: aiohttp.ClientSession, gateways: list[GatewayProcess], n: int
) -> None:
    for fence in itertools.count(1):
        if load.stop:
            return
        gateway = gateways[fence % 2]
        result = await fenced(session, gateway, f"deploy/w{n}", fence, f"w{n}-{fence}")
        receipt = result.headers.get("X-Receipt-Id") if result.headers else None
        if result.headers and result.headers.get("X-Receipt-Outcome") == "unrecorded":
            receipt = None  # answered, and told its receipt could not be written
        load.answered.append((time.monotonic(), f"deploy/w{n}", fence, result.status, receipt))
        if result.status != 200:
            await asyncio.sleep(0.1)


def longest_gap(load: Load, after: float) -> float:
    """The longest time between two 2xx answers from the last one before `after` on (the
    outage as the clients saw it)."""
    times = sorted(t for t, _r, _f, status, _id in load.answered if status == 200)
    since = [t for t in times if t <= after][-1:] + [t for t in times if t > after]
    return max((b - a for a, b in itertools.pairwise(since)), default=0.0)


class TestFailoverUnderLoad:
    async def test_a_switchover_and_a_kill_lose_nothing_and_hold_nothing(
        self,
        sync_cluster: Cluster,
        database: str,
        gateway_factory: GatewayFactory,
        upstream: RecordingUpstream,
        session: aiohttp.ClientSession,
    ) -> None:
        gateways = await replicas(gateway_factory, upstream, sync_cluster.url(database), **SYNC)
        lease = await acquire(session, gateways[0], "holder")
        load = Load()
        tasks = [asyncio.create_task(worker(load, session, gateways, n)) for n in range(4)]
        try:
            await asyncio.sleep(1)
            # the cluster's helpers block: in a thread, so that the load goes on meanwhile
            began = time.monotonic()
            await asyncio.to_thread(sync_cluster.switchover)
            await asyncio.to_thread(sync_cluster.wait_streaming, 2)
            await asyncio.sleep(2)
            switchover_s = longest_gap(load, began)
            # synchronous_mode_strict promotes only the standby Patroni has named synchronous:
            # a kill before the new primary named one would leave the cluster without a leader
            await asyncio.to_thread(sync_cluster.sync_standby)
            killed = await asyncio.to_thread(sync_cluster.kill_primary)
            began = time.monotonic()  # once its processes are gone
            await asyncio.to_thread(sync_cluster.wait_primary, 60.0, killed)
            await wait_for(lambda: ok_after(load, began), timeout=90, interval=0.2)
            await asyncio.sleep(1)
            kill_s = longest_gap(load, began)
        finally:
            load.stop = True
            await asyncio.gather(*tasks)
        # Same lease, same fence: kept across both.
        kept = await until_answered(
            lambda: fenced(session, gateways[1], "run/x", lease, "lease-after")
        )
        assert kept.status == 200, kept.body
        statuses = {status for _t, _r, _f, status, _id in load.answered}
        assert statuses <= {200, 503}, statuses  # never a stale fence: nothing was forgotten
        # The tool got each resource's fences in increasing order, each at most once.
        for n in range(4):
            got = [r.fence for r in sorted(upstream.requests, key=lambda r: r.seq)
                   if r.resource == f"deploy/w{n}"]  # fmt: skip
            assert got == sorted(set(got)), got
        # Every acknowledged receipt is there, succeeded.
        acknowledged = {rid for _t, _r, _f, status, rid in load.answered if status == 200 and rid}
        receipts = {r["id"]: r for r in await fetch_receipts(session, gateways[0].url)}
        lost = [(rid, receipts.get(rid)) for rid in acknowledged]
        assert [x for x in lost if x[1] is None or x[1]["status"] != "succeeded"] == []
        # Two new epochs (the switchover's, the kill's), neither with the floor applied.
        floors = await epochs_recorded(session, tuple(gateways), total=2)
        applied, not_needed = (sum(c[which] for c in floors) for which in ("applied", "not_needed"))
        assert (applied, not_needed) == (0, 2), floors
        print(
            f"\nsync failover as a client of the gateway saw it: switchover {switchover_s:.1f}s, "
            f"kill -9 {kill_s:.1f}s ({len(acknowledged)} calls acknowledged)"
        )
        sync_cluster.rejoin(killed)


def ok_after(load: Load, after: float) -> bool:
    return sum(1 for t, _r, _f, status, _id in load.answered if status == 200 and t > after) > 8
