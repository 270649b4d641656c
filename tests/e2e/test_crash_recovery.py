"""A gateway killed with `kill -9` mid-call: nothing lost, nothing left pending, fences kept.

docs/contract.md §3 (outcome table: "the gateway died before recording the outcome"), §9
(recovery turns every `pending` receipt of earlier runs of a SQLite database `outcome_unknown`)
and §1 (a fence survives restarts).
"""

from __future__ import annotations

import asyncio
import time

from tests.harness import (
    Behavior,
    GatewayFactory,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    make_policy,
    pick,
    problem,
)


class TestKill9WithCallsInFlight:
    """Ten calls admitted and forwarded, then the gateway process is killed with SIGKILL."""

    async def test_in_flight_receipts_become_outcome_unknown_and_fence_survives(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        # A slow sweep: the heartbeat rule (silent for three intervals, 6 s) cannot be what
        # recovers these receipts within the window below; recovery at start must.
        sweep_s = 2.0
        gateway = await gateway_factory(
            make_policy(upstream.url, [{"match": "crash/*"}], timeout_s=10),
            sweep_interval_s=sweep_s,
        )
        resource = "crash/r1"
        upstream.default = Behavior(delay=3.0)
        calls = [
            asyncio.create_task(
                call(
                    session,
                    "POST",
                    f"{gateway.url}/tool/charge/{i}",
                    label=i,
                    data=f'{{"charge": {i}}}'.encode(),
                    headers=fenced_headers(resource, 7, owner="worker-7"),
                )
            )
            for i in range(10)
        ]
        await upstream.wait_received(10, timeout=5)
        await gateway.kill9()
        lost = await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert [r.status for r in lost] == [None] * 10, "the clients lost their connections"

        upstream.default = Behavior()
        await gateway.restart()

        # docs/contract.md §9: at start, every `pending` receipt of earlier runs of a SQLite
        # database is turned `outcome_unknown`; allow one sweep interval for it to become visible.
        deadline = time.monotonic() + sweep_s + 0.5
        receipts = await fetch_receipts(session, gateway.url, resource=resource)
        while any(r["status"] == "pending" for r in receipts) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            receipts = await fetch_receipts(session, gateway.url, resource=resource)

        fields = ("resource", "fence", "owner", "method", "path", "status", "reject_code")
        assert sorted((pick(r, fields) for r in receipts), key=lambda v: v["path"]) == [
            {
                "resource": resource,
                "fence": 7,
                "owner": "worker-7",
                "method": "POST",
                "path": f"/charge/{i}",
                "status": "outcome_unknown",
                "reject_code": None,
            }
            for i in range(10)
        ]
        # None lost: exactly the receipts the tool was told about.
        assert {r["id"] for r in receipts} == {
            rec.headers.get("X-Receipt-Id") for rec in upstream.requests
        }
        assert all(r["forwarded_at"] is not None for r in receipts)

        # A token below the highest accepted before the crash is still stale ...
        stale = await call(
            session,
            "POST",
            f"{gateway.url}/tool/charge/late",
            data=b'{"charge": "late"}',
            headers=fenced_headers(resource, 6, owner="worker-6"),
        )
        assert pick(problem(stale), ("status", "code", "resource", "fence")) == {
            "status": 409,
            "code": "stale_fence",
            "resource": resource,
            "fence": 6,
        }
        assert len(upstream.requests) == 10

        # ... while a newer owner still gets through (the restart did not wedge the resource).
        fresh = await call(
            session,
            "POST",
            f"{gateway.url}/tool/charge/new",
            data=b'{"charge": "new"}',
            headers=fenced_headers(resource, 8, owner="worker-8"),
        )
        assert fresh.status == 200, fresh
        assert [r.fence for r in upstream.requests[10:]] == [8]
