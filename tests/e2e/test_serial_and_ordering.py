"""Per-resource ordering: `concurrency: serial`, and takeover ordering in parallel mode.

docs/contract.md §3, "Ordering on takeover": a call whose fence is higher than the fence of
calls of the same resource still in flight waits until those complete; with
`concurrency: serial`, calls are forwarded one at a time in arrival order and admission runs at
the head of the queue.

The gateway runs as a subprocess, except in the last classes: there it runs in process
(`make_app`), where a test reads a receipt while its call is held, stalls a client's socket,
or makes one store write fail.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest

from gateway.core.errors import StoreUnavailable
from gateway.core.times import parse_rfc3339
from tests.harness import (
    AppFactory,
    Behavior,
    CallResult,
    GatewayFactory,
    InProcessGateway,
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


# --------------------------------------------------------------------------------------------
# In process
# --------------------------------------------------------------------------------------------


@pytest.fixture
async def gw(make_app: AppFactory, upstream: RecordingUpstream) -> InProcessGateway:
    """Two upstreams over one tool: `/tool` serves `shared/*` in parallel, `/serial` serially."""
    parallel = make_policy(upstream.url, [{"match": "shared/*"}], timeout_s=1)
    serial = make_policy(
        upstream.url,
        [{"match": "shared/*", "concurrency": "serial"}],
        name="serial",
        mount="/serial",
        timeout_s=1,
    )
    policy = {
        "upstreams": parallel["upstreams"] + serial["upstreams"],
        "resources": parallel["resources"] + serial["resources"],
    }
    return await make_app(policy, body_timeout_s=0.5, reconcile_grace_s=0)


async def older_held_then_newer(
    gw: InProcessGateway, upstream: RecordingUpstream, resource: str, newer_path: str
) -> tuple[asyncio.Event, asyncio.Task[Any], asyncio.Task[Any]]:
    """Fence 1 of `resource` sent to `/tool/old` and held at the tool until the event is set,
    then fence 2 sent to `newer_path`: the event, and the tasks of both calls."""
    gate = asyncio.Event()
    upstream.script("/api/old", Behavior(gate=gate))
    old = asyncio.create_task(gw.client.post("/tool/old", headers=fenced_headers(resource, 1)))
    await upstream.wait_received(1)
    new = asyncio.create_task(gw.client.post(newer_path, headers=fenced_headers(resource, 2)))
    return gate, old, new


class TestTakeoverAcrossRules:
    """A newer fence never overtakes an older call in flight, and its grace counts from
    when it really left."""

    async def test_a_serial_rule_waits_for_a_parallel_rules_older_call(self, gw, upstream):
        gate, old, new = await older_held_then_newer(gw, upstream, "shared/a", "/serial/new")
        await asyncio.sleep(0.2)
        assert [r.path for r in upstream.received()] == ["/api/old"]
        gate.set()
        for task in (old, new):
            (await task).release()
        assert [r.path for r in upstream.received()] == ["/api/old", "/api/new"]

    async def test_a_call_that_waited_is_forwarded_at_when_it_left(self, gw, upstream):
        """Durably, before it leaves: if the gateway dies while the call runs, a reconciler's
        grace still counts from when the tool got it, not from its admission."""
        new_gate = asyncio.Event()
        upstream.script("/api/new", Behavior(gate=new_gate))
        old_gate, old, new = await older_held_then_newer(gw, upstream, "shared/b", "/tool/new")
        await asyncio.sleep(0.3)
        old_gate.set()
        (await old).release()
        await upstream.wait_received(1, path="/api/new")
        [sent] = upstream.received(path="/api/new")
        pending = await gw.receipt(sent.headers["X-Receipt-Id"])
        new_gate.set()
        (await new).release()
        assert pending["status"] == "pending"
        waited = parse_rfc3339(pending["forwarded_at"]) - parse_rfc3339(pending["created_at"])
        assert waited >= 0.25


class TestSerialCommits:
    """`serial` on one resource: a call's outcome and the next call's admission, whose turn
    that outcome gives, share a commit (on SQLite, whose writes commit in the order they are
    asked for), so a queue of calls costs about one fsync a call, not two."""

    async def test_a_queue_of_calls_takes_about_one_commit_each(self, gw, upstream):
        calls = 20
        before = gw.store.committer.batches

        async def one(n: int) -> int:
            async with await gw.client.post(
                "/serial/act", headers=fenced_headers("shared/q", 1), json={"n": n}
            ) as answer:
                return answer.status

        assert await asyncio.gather(*(one(n) for n in range(calls))) == [200] * calls
        commits = gw.store.committer.batches - before
        # one each, the first admission's own, and the sweeper's few (every 0.1 s here);
        # an outcome committed apart from the next admission would make about 2 * calls
        assert commits < 1.5 * calls, commits


class TestWaitedCallStoreFailure:
    """A call that waited behind an older one and cannot durably record when it left is not
    sent: its receipt says `not_sent`, never `outcome_unknown`."""

    async def test_a_failed_forwarded_at_write_leaves_the_call_not_sent(
        self, gw, upstream, monkeypatch
    ):
        """A store failing between two writes cannot be had for real: that write is made
        to fail by hand. The call must then be known as never sent, not outcome_unknown."""

        async def failing(_receipt_id: str) -> None:
            raise StoreUnavailable("disk gone")

        monkeypatch.setattr(gw.store, "mark_forwarded", failing)
        gate, old, new = await older_held_then_newer(gw, upstream, "shared/e", "/tool/new")
        await asyncio.sleep(0.1)
        gate.set()
        (await old).release()
        async with await new as answer:
            assert (answer.status, (await answer.json())["code"]) == (503, "store_unavailable")
            record = await gw.receipt(answer.headers["X-Receipt-Id"])
        assert (record["status"], record["error"]) == ("not_sent", "store_unavailable")
        assert [r.path for r in upstream.received()] == ["/api/old"]


class TestStalledClient:
    """A client that stops reading its answer cannot hold its resource past the deadline."""

    async def test_new_owner_gets_through(self, gw, upstream):
        upstream.script("/api/big", Behavior(body=b"x" * (16 * 1024 * 1024)))
        _reader, writer = await asyncio.open_connection(gw.host, gw.port)
        writer.write(
            b"POST /tool/big HTTP/1.1\r\nHost: x\r\nX-Lease-Resource: shared/c\r\n"
            b"X-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n"
        )
        await writer.drain()  # ... and never read a byte of the answer
        await upstream.wait_received(1)
        try:
            async with gw.client.post(
                "/tool/next", headers=fenced_headers("shared/c", 2)
            ) as answer:
                assert answer.status == 200
        finally:
            writer.close()


class TestStalledReplay:
    """A replay reaches no tool: its resource's place (the serial turn, the fence) is let go
    before the stored answer is written, so a client that does not read its replay holds up
    no other call of the resource, as a forwarded call's relay does not. The same for an MCP
    tool call's replay (docs/contract.md §16)."""

    BIG = 24 * 1024 * 1024  # more than loopback's socket buffers hold

    @staticmethod
    def _request(
        mcp: bool, resource: str, fence: int, what: str
    ) -> tuple[str, dict[str, str], bytes]:
        """A fenced call of `what`: its path, headers and body."""
        headers = fenced_headers(resource, fence)
        if not mcp:
            return f"/tool/{what}", {**headers, "Idempotency-Key": f"k-{what}"}, b""
        call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": what}}
        headers = {**headers, "Accept": "application/json, text/event-stream"}
        return (
            "/tool/mcp",
            {**headers, "Content-Type": "application/json"},
            json.dumps(call).encode(),
        )

    async def _replay_stalled(
        self, make_app: AppFactory, upstream: RecordingUpstream, rule: dict[str, Any], mcp: bool
    ) -> tuple[InProcessGateway, asyncio.StreamWriter]:
        """A call with a big answer kept for replay, then the same call again by a client
        that reads nothing of its replay."""
        rule = {**rule, "queue_timeout_s": 0.5, "idempotency": {"replay_max_bytes": self.BIG}}
        if mcp:
            rule["tools"] = ["send_*"]
        policy = make_policy(upstream.url, [rule], timeout_s=10, mcp=mcp)
        gw = await make_app(policy, body_timeout_s=5)
        text = "x" * (self.BIG - 100)  # the whole answer within replay_max_bytes
        big = {"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "text", "text": text}]}}
        upstream.script(
            "/api/mcp" if mcp else "/api/send_big", Behavior(body=json.dumps(big).encode())
        )
        resource = rule["match"].replace("*", "a")
        path, headers, body = self._request(mcp, resource, 1, "send_big")
        async with gw.client.post(path, headers=headers, data=body) as answer:
            assert answer.status == 200
            assert len(await answer.read()) > self.BIG - 100
        _reader, writer = await asyncio.open_connection(gw.host, gw.port)
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        await asyncio.sleep(0.5)  # the replay is being written, and stalls
        return gw, writer

    async def _next_call_goes_through(
        self,
        gw: InProcessGateway,
        upstream: RecordingUpstream,
        resource: str,
        fence: int,
        mcp: bool,
    ) -> None:
        upstream.script("/api/mcp" if mcp else "/api/send_next", Behavior())
        path, headers, body = self._request(mcp, resource, fence, "send_next")
        async with gw.client.post(path, headers=headers, data=body) as answer:
            assert answer.status == 200, (answer.status, (await answer.text())[:300])
        assert len(upstream.received()) == 2

    @pytest.mark.parametrize("mcp", [False, True], ids=["plain", "mcp"])
    async def test_the_serial_turn_is_not_held(
        self, make_app: AppFactory, upstream: RecordingUpstream, mcp: bool
    ) -> None:
        gw, writer = await self._replay_stalled(
            make_app, upstream, {"match": "ser/*", "concurrency": "serial"}, mcp
        )
        try:
            await self._next_call_goes_through(gw, upstream, "ser/a", 1, mcp)
        finally:
            writer.close()

    @pytest.mark.parametrize("mcp", [False, True], ids=["plain", "mcp"])
    async def test_a_new_owner_does_not_wait_for_it(
        self, make_app: AppFactory, upstream: RecordingUpstream, mcp: bool
    ) -> None:
        gw, writer = await self._replay_stalled(make_app, upstream, {"match": "par/*"}, mcp)
        try:
            await self._next_call_goes_through(gw, upstream, "par/a", 2, mcp)
        finally:
            writer.close()
