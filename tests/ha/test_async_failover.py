"""An asynchronous failover that lost commits never reopens a fence (docs/contract.md §19):
two gateway processes on a real Patroni cluster, the standby made to lag, fences accepted on
the primary alone, the primary killed and the lagging standby promoted.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.ha.cluster import Cluster
from tests.harness import (
    CallResult,
    GatewayFactory,
    GatewayProcess,
    RecordingUpstream,
    call,
    fenced_headers,
    make_policy,
    metric_samples,
    problem_summary,
)


@pytest.fixture
def database(async_cluster: Cluster) -> Iterator[str]:
    name = f"fg_ha_{secrets.token_hex(4)}"
    async_cluster.create_database(name)
    yield name
    async_cluster.drop_database(name)


def policy(upstream: RecordingUpstream) -> dict[str, Any]:
    return make_policy(
        upstream.url,
        [
            {"match": "deploy/*"},  # external issuer
            {"match": "run/*", "lease": {"issuer": "gateway", "ttl_s": 120, "max_ttl_s": 300}},
        ],
    )


async def replicas(
    gateway_factory: GatewayFactory, upstream: RecordingUpstream, url: str, **env: str
) -> list[GatewayProcess]:
    return list(
        await asyncio.gather(
            *(
                gateway_factory(
                    policy(upstream),
                    sweep_interval_s=0.5,
                    extra_env={
                        "GATEWAY_DATABASE_URL": url,
                        "GATEWAY_INSTANCE_ID": f"replica-{i}",
                        "GATEWAY_DATABASE_CONNECT_TIMEOUT_S": "2",
                        **env,
                    },
                )
                for i in range(2)
            )
        )
    )


async def fenced(
    session: aiohttp.ClientSession, gateway: GatewayProcess, resource: str, fence: int, tag: str
) -> CallResult:
    return await call(
        session,
        "POST",
        f"{gateway.url}/tool/op",
        label=tag,
        data=f'{{"call": "{tag}"}}'.encode(),
        # a fresh key each time: a call asked again after a 503 is a new call
        headers=fenced_headers(resource, fence, **{"Idempotency-Key": secrets.token_hex(8)}),
    )


async def acquire(session: aiohttp.ClientSession, gateway: GatewayProcess, owner: str) -> int:
    got = await call(
        session, "POST", f"{gateway.url}/_gateway/v1/leases/run/x", json={"owner": owner}
    )
    assert got.status == 201, got.body
    return int(got.json()["fence"])


async def until_answered(
    attempt: Any, timeout: float = 90.0, unavailable: tuple[int, ...] = (503,)
) -> CallResult:
    """`attempt()` again while the gateway answers 503 (no primary accepts writes)."""
    deadline = time.monotonic() + timeout
    while True:
        result: CallResult = await attempt()
        if result.status not in unavailable and result.status is not None:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"still {problem_summary(result)} after {timeout}s")
        await asyncio.sleep(0.2)


async def epochs_recorded(
    session: aiohttp.ClientSession,
    gateways: tuple[GatewayProcess, ...],
    total: int,
    timeout: float = 10.0,
) -> list[dict[str, float]]:
    """Each replica's `fence_gateway_store_epochs_total` by `floor`, once the replicas together
    show `total` epochs (or after `timeout`). The store records an epoch on whichever call
    first reaches a new primary; the replica reports it after its next heartbeat, so a count
    can lag a call that already saw the new primary by a heartbeat."""
    deadline = time.monotonic() + timeout
    while True:
        counts = []
        for g in gateways:
            samples = await metric_samples(session, g.url, "fence_gateway_store_epochs_total")
            counts.append(
                {floor: samples.get(f'floor="{floor}"', 0.0) for floor in ("applied", "not_needed")}
            )
        if sum(sum(c.values()) for c in counts) >= total or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.2)


class TestAsyncFailover:
    async def test_the_lost_fences_are_never_accepted_again_and_the_floor_is_applied_once(
        self,
        async_cluster: Cluster,
        database: str,
        gateway_factory: GatewayFactory,
        upstream: RecordingUpstream,
        session: aiohttp.ClientSession,
    ) -> None:
        a, b = await replicas(gateway_factory, upstream, async_cluster.url(database))
        assert (await fenced(session, a, "deploy/web", 5, "five")).status == 200
        lease_1 = await acquire(session, b, "w1")
        standby = async_cluster.standbys()[0]
        with async_cluster.lagging(standby):
            # Acknowledged by the primary alone: the standby receives none of it.
            assert (await fenced(session, a, "deploy/web", 20, "twenty")).status == 200
            released = await call(
                session,
                "DELETE",
                f"{b.url}/_gateway/v1/leases/run/x",
                params={"owner": "w1", "fence": str(lease_1)},
            )
            assert released.status == 204
            lease_2 = await acquire(session, a, "w2")
            assert lease_2 == lease_1 + 1
            assert (await fenced(session, b, "run/x", lease_2, "lease-two")).status == 200
            old = async_cluster.kill_primary()
        try:
            killed_at = time.monotonic()
            seen = len(upstream.requests)
            # fence 15 lies between the promoted store's highest (5) and the last acknowledged
            # one (20); lease 2 was acknowledged, then forgotten by the promotion
            stale = await until_answered(lambda: fenced(session, b, "deploy/web", 15, "fifteen"))
            failover_s = time.monotonic() - killed_at
            assert problem_summary(stale) == (409, "stale_fence")
            # Either replica may still answer 503 for a moment: no primary yet, or its instance
            # lapsed while the store was away and the call in hand was not sent.
            two_again = await until_answered(
                lambda: fenced(session, a, "run/x", lease_2, "two-again")
            )
            assert problem_summary(two_again) == (409, "stale_fence")
            on_hold = await until_answered(lambda: fenced(session, a, "deploy/web", 25, "held"))
            assert problem_summary(on_hold) == (409, "stale_fence")
            assert len(upstream.requests) == seen  # none of them reached the tool
            async with session.get(f"{b.url}/_gateway/console") as resp:
                overview = await resp.text()
            assert "Latest store epoch change" in overview and "a new timeline" in overview
            assert "<li><code>deploy/*</code></li>" in overview  # on hold
            # The next lease is issued above the floor; the external resource once raised.
            assert await acquire(session, b, "w3") >= 1_000_000
            raised = await call(
                session, "PUT", f"{a.url}/_gateway/v1/fences/deploy/web", json={"at_least": 20}
            )
            assert raised.status == 200, raised.body
            after = await until_answered(
                lambda: fenced(session, b, "deploy/web", 25, "after-raise")
            )
            assert after.status == 200
            # Exactly one replica recorded the new epoch, with the floor.
            counts = [c["applied"] for c in await epochs_recorded(session, (a, b), total=1)]
            assert sorted(counts) == [0.0, 1.0]
            recorder = (a, b)[counts.index(1.0)]
            said = [
                line
                for line in recorder.stderr_text().splitlines()
                if "store_epoch_changed" in line
            ]
            # the promoted store's highest fence was 5: fence 20 and lease 2 were lost with it
            assert len(said) == 1 and "floor=1000005" in said[0], said
            primary = async_cluster.wait_primary()
            rows = async_cluster.sql(
                primary, "SELECT floor, reason FROM store_epochs ORDER BY id", database
            )
            assert rows == [["", "first epoch"], ["applied", "a new timeline (a promotion)"]]
            print(f"async kill -9 failover as the client saw it: {failover_s:.1f}s")
        finally:
            async_cluster.rejoin(old)  # the next test's cluster has its standby again
