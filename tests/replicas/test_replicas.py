"""Two gateway processes on one PostgreSQL database are exactly as safe as one
(docs/contract.md §14): real processes, a real upstream that records what it received, kill -9,
SIGSTOP, and a database that goes away.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import time
from typing import Any

import aiohttp

from tests.harness import (
    Behavior,
    CallResult,
    GatewayProcess,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    make_policy,
    problem,
    problem_summary,
    wait_for,
)
from tests.pg import run_sync, server_sql
from tests.replicas.conftest import Replicas

SWEEP_S = 0.2  # so an instance is silent after 0.6 s, lapsed after 0.4 s
LEASES = "/_gateway/v1/leases"


def policy(upstream: RecordingUpstream, **rule: Any) -> dict[str, Any]:
    return make_policy(
        upstream.url,
        [
            {"match": "deploy/*", "queue_timeout_s": 10, **rule},
            {"match": "run/*", "lease": {"issuer": "gateway", "ttl_s": 5, "max_ttl_s": 10}},
        ],
    )


async def post(
    session: aiohttp.ClientSession,
    gateway: GatewayProcess,
    resource: str,
    fence: int,
    path: str = "op",
    label: Any = None,
) -> CallResult:
    return await call(
        session,
        "POST",
        f"{gateway.url}/tool/{path}",
        label=fence if label is None else label,
        data=f'{{"fence": {fence}, "call": "{label}"}}'.encode(),
        headers=fenced_headers(resource, fence),
    )


async def receipts_of(
    session: aiohttp.ClientSession, gateway: GatewayProcess, **filters: Any
) -> list[dict[str, Any]]:
    return await fetch_receipts(session, gateway.url, **filters)


def fences_in_arrival_order(upstream: RecordingUpstream) -> list[int | None]:
    return [r.fence for r in sorted(upstream.requests, key=lambda r: r.seq)]


def overlaps(upstream: RecordingUpstream) -> list[tuple[int, int]]:
    """Pairs (lower, higher) where the tool got the higher fence while the lower was running."""
    return [
        (low.fence, high.fence)
        for high in upstream.requests
        for low in upstream.requests
        if low.fence is not None
        and high.fence is not None
        and low.fence < high.fence
        and (low.completed_at is None or low.completed_at > high.received_at)
    ]


class TestOneTruth:
    async def test_a_fence_accepted_through_one_replica_is_enforced_by_the_other(
        self, upstream: RecordingUpstream, replicas: Replicas, session: aiohttp.ClientSession
    ) -> None:
        a, b = await replicas(policy(upstream))
        assert (await post(session, a, "deploy/web", 5)).status == 200
        stale = await post(session, b, "deploy/web", 4)
        assert problem_summary(stale) == (409, "stale_fence")
        # The same call again through the other replica is the same call: its answer replayed.
        again = await post(session, b, "deploy/web", 5)
        assert again.status == 200 and again.headers is not None
        assert again.headers["Idempotent-Replayed"] == "true"
        assert (await post(session, b, "deploy/web", 6)).status == 200
        assert fences_in_arrival_order(upstream) == [5, 6]

    async def test_30_concurrent_acquires_over_both_give_one_lease(
        self, upstream: RecordingUpstream, replicas: Replicas, session: aiohttp.ClientSession
    ) -> None:
        gateways = await replicas(policy(upstream))
        results = await asyncio.gather(
            *(
                call(
                    session,
                    "POST",
                    f"{gateways[i % 2].url}{LEASES}/run/contested",
                    json={"owner": f"worker-{i}"},
                    label=f"worker-{i}",
                )
                for i in range(30)
            )
        )
        winners = [r for r in results if r.status == 201]
        assert len(winners) == 1, [(r.status, r.body[:80]) for r in results]
        assert winners[0].json()["fence"] == 1
        assert {problem_summary(r) for r in results if r.status != 201} == {(409, "lease_held")}
        # A lease granted through one replica is renewed and released through the other.
        lease = winners[0].json()
        other = gateways[1 - results.index(winners[0]) % 2]
        body = {"owner": lease["owner"], "fence": lease["fence"]}
        renewed = await call(session, "PUT", f"{other.url}{LEASES}/run/contested", json=body)
        assert renewed.status == 200, renewed.body
        released = await call(
            session,
            "DELETE",
            f"{other.url}{LEASES}/run/contested",
            params={"owner": lease["owner"], "fence": str(lease["fence"])},
        )
        assert released.status == 204, released.body

    async def test_80_calls_with_random_fences_over_both_pass_the_real_time_check(
        self, upstream: RecordingUpstream, replicas: Replicas, session: aiohttp.ClientSession
    ) -> None:
        gateways = await replicas(policy(upstream))
        upstream.default = Behavior(delay=0.05)
        rng = random.Random(80)
        fences = list(range(1, 81))
        rng.shuffle(fences)
        # Eight bursts of ten, 0.3 s apart: within a burst calls race across the replicas;
        # across bursts earlier calls have ended before later ones start.
        stagger = {f: (i // 10) * 0.3 + rng.uniform(0, 0.01) for i, f in enumerate(fences)}
        via = {f: gateways[rng.randrange(2)] for f in fences}

        async def one(fence: int) -> CallResult:
            await asyncio.sleep(stagger[fence])
            return await post(session, via[fence], "deploy/race", fence)

        results = await asyncio.wait_for(asyncio.gather(*(one(f) for f in fences)), 60)
        by_fence = {r.label: r for r in results}
        admitted = sorted(f for f, r in by_fence.items() if r.status == 200)
        rejected = sorted(f for f, r in by_fence.items() if r.status != 200)
        assert {problem_summary(by_fence[f]) for f in rejected} <= {(409, "stale_fence")}
        assert 80 in admitted
        # The tool saw each admitted call once, never a fence lower than one it had seen, and
        # never a higher fence while a lower one was still running.
        arrived = fences_in_arrival_order(upstream)
        assert sorted(arrived) == admitted  # type: ignore[type-var]
        assert arrived == sorted(arrived)  # type: ignore[type-var]
        assert overlaps(upstream) == []
        # Real time: X ended before Y began, both admitted ⇒ fence(X) ≤ fence(Y) …
        sequential = [
            (x, y)
            for x, y in itertools.permutations(admitted, 2)
            if by_fence[x].completed_at < by_fence[y].invoked_at
        ]
        assert sequential and [(x, y) for x, y in sequential if x > y] == []
        # … and every refusal had a higher fence admitted before it ended.
        assert [
            f
            for f in rejected
            if not any(
                a > f and by_fence[a].invoked_at < by_fence[f].completed_at for a in admitted
            )
        ] == []

    async def test_serial_holds_across_replicas(
        self, upstream: RecordingUpstream, replicas: Replicas, session: aiohttp.ClientSession
    ) -> None:
        gateways = await replicas(policy(upstream, concurrency="serial", queue_timeout_s=20))
        upstream.default = Behavior(delay=0.03)
        results = await asyncio.wait_for(
            asyncio.gather(
                *(post(session, gateways[i % 2], "deploy/serial", 3, label=i) for i in range(20))
            ),
            30,
        )
        assert [problem_summary(r) for r in results] == [(200, None)] * 20
        assert upstream.max_inflight == {"deploy/serial": 1}
        ordered = sorted(upstream.requests, key=lambda r: r.received_at)
        assert [
            (a.seq, b.seq)
            for a, b in itertools.pairwise(ordered)
            if a.completed_at is None or b.received_at < a.completed_at
        ] == []
        # Both replicas forwarded some of them: the turns really were shared.
        instances = {r["instance"] for r in await receipts_of(session, gateways[0])}
        assert instances == {"replica-0", "replica-1"}


class TestAReplicaDies:
    async def test_kill_9_its_pending_receipts_become_outcome_unknown_and_peers_go_on(
        self, upstream: RecordingUpstream, replicas: Replicas, session: aiohttp.ClientSession
    ) -> None:
        a, b = await replicas(policy(upstream), sweep_interval_s=SWEEP_S)
        upstream.script("/api/slow", Behavior(gate=asyncio.Event()))  # never answers
        lost = asyncio.create_task(post(session, a, "deploy/web", 1, path="slow"))
        await upstream.wait_received(1)
        [pending] = await receipts_of(session, b, resource="deploy/web")
        assert (pending["status"], pending["instance"]) == ("pending", "replica-0")

        await a.kill9()
        killed = time.monotonic()
        # The newer call through the survivor waits for the dead replica's call (it might
        # still be running at the tool) until the survivor's sweeper gives it up.
        newer = await post(session, b, "deploy/web", 2)
        assert newer.status == 200, newer.body
        [receipt] = await receipts_of(session, b, resource="deploy/web", fence_max=1)
        assert (receipt["status"], receipt["error"]) == ("outcome_unknown", "outcome_not_recorded")
        # about three sweep intervals (0.6 s) plus a sweep, with room for a busy machine
        assert time.monotonic() - killed < 3.0
        assert fences_in_arrival_order(upstream) == [1, 2]
        lost.cancel()

        more = [await post(session, b, "deploy/web", 2, label=i) for i in range(5)]
        assert [r.status for r in more] == [200] * 5
        statuses = [r["status"] for r in await receipts_of(session, b, fence_min=2)]
        assert statuses == ["succeeded"] * 6


class TestAPausedReplicaFencesItself:
    """A replica paused (SIGSTOP) past its heartbeat lease, with a call admitted but not yet
    forwarded, wakes up after its peers gave that call up and a newer owner's call reached the
    tool: it must not deliver the old call. It answers 503 and goes on under a new instance
    id."""

    async def test_the_old_call_is_never_sent_after_the_newer_one(
        self, upstream: RecordingUpstream, replicas: Replicas, session: aiohttp.ClientSession
    ) -> None:
        a, b = await replicas(policy(upstream), sweep_interval_s=SWEEP_S)
        release = asyncio.Event()
        upstream.script("/api/slow", Behavior(gate=release))
        first = asyncio.create_task(post(session, b, "deploy/web", 1, path="slow"))
        await upstream.wait_received(1)
        # Fence 2 through A is admitted and waits for fence 1, in flight through B.
        old = asyncio.create_task(post(session, a, "deploy/web", 2))
        await wait_for_receipt(session, b, fence_min=2, status="pending")
        assert a.proc is not None
        a.proc.send_signal(signal.SIGSTOP)
        try:
            # B gives A's call up once A is silent for three intervals …
            await wait_for_receipt(session, b, fence_min=2, status="outcome_unknown")
            # … so the newer owner's call waits only for fence 1, and reaches the tool.
            newer = asyncio.create_task(post(session, b, "deploy/web", 3))
            await asyncio.sleep(0.1)
            release.set()
            assert (await first).status == 200
            assert (await newer).status == 200
        finally:
            a.proc.send_signal(signal.SIGCONT)
        answer = await old
        assert problem_summary(answer) == (503, "store_unavailable")
        assert "heartbeat" in problem(answer)["detail"]
        assert fences_in_arrival_order(upstream) == [1, 3]
        # Its peers gave it up before it woke: it stays `outcome_unknown` for a reconciler
        # (only a receipt still `pending` would be completed `not_sent`, `instance_lapsed`).
        [receipt] = await receipts_of(session, b, fence_min=2, fence_max=2)
        assert (receipt["status"], receipt["instance"]) == ("outcome_unknown", "replica-0")
        # The replica serves on under a new id.
        ready = await call(session, "GET", f"{a.url}/_gateway/readyz")
        assert (ready.status, ready.json()["instance"]) == (200, "replica-0.1")
        assert (await post(session, a, "deploy/web", 4)).status == 200
        assert fences_in_arrival_order(upstream) == [1, 3, 4]

    async def test_random_pauses_never_reorder_fences(
        self, upstream: RecordingUpstream, replicas: Replicas, session: aiohttp.ClientSession
    ) -> None:
        """Owners with rising fences call through both replicas while a nemesis pauses one
        of them at random moments for random times, some longer than its heartbeat lease.
        Whatever got through, the tool saw fences in order and never two at once."""
        a, b = await replicas(policy(upstream), sweep_interval_s=SWEEP_S)
        upstream.default = Behavior(delay=0.02)
        rng = random.Random(11)
        fence = itertools.count(1)
        stop = asyncio.Event()
        results: list[CallResult] = []

        async def owner() -> None:
            while not stop.is_set():
                results.append(await post(session, rng.choice((a, b)), "deploy/p", next(fence)))
                await asyncio.sleep(rng.uniform(0, 0.05))

        async def nemesis() -> None:
            assert a.proc is not None
            for _ in range(6):
                await asyncio.sleep(rng.uniform(0.1, 0.4))
                a.proc.send_signal(signal.SIGSTOP)
                await asyncio.sleep(rng.uniform(0.2, 1.2))
                a.proc.send_signal(signal.SIGCONT)
            stop.set()

        await asyncio.wait_for(asyncio.gather(nemesis(), *(owner() for _ in range(4))), 60)
        assert any(r.status == 200 for r in results)
        allowed = {(200, None), (409, "stale_fence"), (503, "store_unavailable")}
        assert {problem_summary(r) for r in results} <= allowed | {(503, "resource_busy")}
        arrived = fences_in_arrival_order(upstream)
        assert arrived == sorted(arrived)  # type: ignore[type-var]
        assert overlaps(upstream) == []

        # Every call the tool saw has its receipt, and none is left pending (the sweepers
        # give up a lapsed instance's calls within a few intervals).
        async def settled() -> bool:
            receipts = await receipts_of(session, b, resource="deploy/p", status="pending")
            return not receipts

        await wait_for(settled, timeout=10, interval=0.1, what="no receipt left pending")
        receipts = {r["fence"] for r in await receipts_of(session, b, resource="deploy/p")}
        assert all(f in receipts for f in arrived)


async def wait_for_receipt(
    session: aiohttp.ClientSession, gateway: GatewayProcess, **filters: Any
) -> None:
    async def found() -> bool:
        return bool(await receipts_of(session, gateway, **filters))

    await wait_for(found, timeout=10, interval=0.05, what=f"a receipt matching {filters}")


class TestTheDatabaseGoesAway:
    async def test_fenced_calls_fail_closed_and_the_replica_recovers_by_itself(
        self,
        upstream: RecordingUpstream,
        replicas: Replicas,
        pg_url: str,
        session: aiohttp.ClientSession,
    ) -> None:
        [gateway] = await replicas(policy(upstream), 1, sweep_interval_s=SWEEP_S)
        assert (await post(session, gateway, "deploy/web", 1)).status == 200
        database = pg_url.rsplit("/", 1)[1]
        outage(database, True)
        try:
            answer = await post(session, gateway, "deploy/web", 2)
            assert problem_summary(answer) == (503, "store_unavailable")

            async def not_ready() -> bool:
                ready = await call(session, "GET", f"{gateway.url}/_gateway/readyz")
                return ready.status == 503

            await wait_for(not_ready, timeout=10, interval=0.1, what="readyz to turn 503")
            assert problem_summary(await post(session, gateway, "deploy/web", 3)) == (
                503,
                "store_unavailable",
            )
        finally:
            outage(database, False)

        async def ready() -> bool:
            answer = await call(session, "GET", f"{gateway.url}/_gateway/readyz")
            return answer.status == 200

        await wait_for(ready, timeout=15, interval=0.1, what="readyz to turn 200 again")
        assert (await post(session, gateway, "deploy/web", 4)).status == 200
        assert fences_in_arrival_order(upstream) == [1, 4]
        assert gateway.returncode is None


def outage(database: str, on: bool) -> None:
    """Refuse (or allow again) new connections to `database`, and cut the existing ones."""
    run_sync(server_sql, f"ALTER DATABASE {database} ALLOW_CONNECTIONS {str(not on).lower()}")
    if on:
        run_sync(
            server_sql,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{database}' AND pid <> pg_backend_pid()",
        )
