"""Per-resource ordering: `concurrency: serial`, and takeover ordering in parallel mode.

SPEC section 3, "Ordering on takeover": a call whose fence is higher than the fence of calls of
the same resource still in flight waits until those complete; with `concurrency: serial`, calls
are forwarded one at a time in arrival order and admission runs at the head of the queue.
"""

from __future__ import annotations

import asyncio
import itertools

from tests.harness import (
    Behavior,
    CallResult,
    GatewayFactory,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    make_policy,
    pick,
    problem,
    problem_summary,
)


class TestSerialMode:
    """With `concurrency: serial` the tool never has two calls of one resource at once."""

    async def test_twenty_concurrent_calls_reach_the_tool_one_at_a_time(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await gateway_factory(
            make_policy(
                upstream.url,
                [{"match": "serial/*", "concurrency": "serial", "queue_timeout_s": 15}],
            )
        )
        upstream.default = Behavior(delay=0.03)
        resource = "serial/r1"
        results = await asyncio.wait_for(
            asyncio.gather(
                *(
                    call(
                        session,
                        "POST",
                        f"{gateway.url}/tool/step",
                        label=i,
                        data=f'{{"step": {i}}}'.encode(),
                        headers=fenced_headers(resource, 3, owner="worker-3"),
                    )
                    for i in range(20)
                )
            ),
            20,
        )
        assert [problem_summary(r) for r in results] == [(200, None)] * 20
        assert len(upstream.requests) == 20
        assert upstream.max_inflight == {resource: 1}
        ordered = sorted(upstream.requests, key=lambda r: r.received_at)
        overlaps = [
            (a.seq, b.seq)
            for a, b in itertools.pairwise(ordered)
            if a.completed_at is None or b.received_at < a.completed_at
        ]
        assert overlaps == []

    async def test_old_fence_queued_behind_newer_is_rejected_without_reaching_the_tool(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await gateway_factory(
            make_policy(
                upstream.url,
                [{"match": "serial/*", "concurrency": "serial", "queue_timeout_s": 15}],
            )
        )
        resource = "serial/r2"
        release_head = asyncio.Event()
        upstream.script("/api/head", Behavior(gate=release_head))

        def send(path: str, fence: int) -> asyncio.Task[CallResult]:
            return asyncio.create_task(
                call(
                    session,
                    "POST",
                    f"{gateway.url}/tool/{path}",
                    label=fence,
                    data=f'{{"fence": {fence}}}'.encode(),
                    headers=fenced_headers(resource, fence, owner=f"worker-{fence}"),
                )
            )

        head = send("head", 5)
        await upstream.wait_received(1)
        newer = send("newer", 7)
        await asyncio.sleep(0.3)  # arrival order: 7 queues first ...
        older = send("older", 6)  # ... then 6, which is newer than 5 but older than 7
        await asyncio.sleep(0.3)
        assert [r.fence for r in upstream.requests] == [5], "queued calls must wait their turn"
        release_head.set()
        head_r, newer_r, older_r = await asyncio.wait_for(asyncio.gather(head, newer, older), 15)

        assert head_r.status == 200, head_r
        assert newer_r.status == 200, newer_r
        assert pick(problem(older_r), ("status", "code", "resource", "fence")) == {
            "status": 409,
            "code": "stale_fence",
            "resource": resource,
            "fence": 6,
        }
        assert [(r.path, r.fence) for r in upstream.requests] == [
            ("/api/head", 5),
            ("/api/newer", 7),
        ]
        receipts = sorted(
            await fetch_receipts(session, gateway.url, resource=resource), key=lambda r: r["id"]
        )
        assert [pick(r, ("path", "fence", "status", "reject_code")) for r in receipts] == [
            {"path": "/head", "fence": 5, "status": "succeeded", "reject_code": None},
            {"path": "/newer", "fence": 7, "status": "succeeded", "reject_code": None},
            {"path": "/older", "fence": 6, "status": "rejected", "reject_code": "stale_fence"},
        ]


class TestTakeoverOrdering:
    """Parallel mode: a higher fence is not forwarded while a lower one is still in flight."""

    async def test_fence_two_waits_for_fence_one_in_flight(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await gateway_factory(
            make_policy(upstream.url, [{"match": "order/*", "queue_timeout_s": 10}])
        )
        resource = "order/r1"
        upstream.script("/api/first", Behavior(delay=0.8))

        first = asyncio.create_task(
            call(
                session,
                "POST",
                f"{gateway.url}/tool/first",
                data=b'{"n": 1}',
                headers=fenced_headers(resource, 1, owner="old-owner"),
            )
        )
        await upstream.wait_received(1, path="/api/first")
        second = await call(
            session,
            "POST",
            f"{gateway.url}/tool/second",
            data=b'{"n": 2}',
            headers=fenced_headers(resource, 2, owner="new-owner"),
        )
        first_r = await asyncio.wait_for(first, 10)

        assert (first_r.status, second.status) == (200, 200)
        (rec1,) = upstream.received(path="/api/first")
        (rec2,) = upstream.received(path="/api/second")
        assert (rec1.fence, rec2.fence) == (1, 2)
        assert rec1.completed_at is not None
        assert second.invoked_at < rec1.completed_at, "fence 2 was sent while fence 1 ran"
        assert rec2.received_at >= rec1.completed_at, (
            f"fence 2 reached the tool {rec1.completed_at - rec2.received_at:.3f}s "
            "before fence 1 completed"
        )
