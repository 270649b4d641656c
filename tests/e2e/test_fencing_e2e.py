"""Fencing with external tokens, end to end: real gateway process, real upstream, real SQLite.

docs/contract.md §3 step 4 (`external` issuer) and §1: a paused former owner can no longer act,
whatever it believes; the upstream never sees a fence lower than one it already saw.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
from typing import Any

import aiohttp

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
)

RECEIPT_FIELDS = (
    "resource",
    "fence",
    "owner",
    "client",
    "upstream",
    "method",
    "path",
    "idempotency_key",
    "fingerprint",
    "attempt",
    "status",
    "http_status",
    "error",
    "reject_code",
    "late",
    "resolution",
)


def receipt_view(receipt: dict[str, Any]) -> dict[str, Any]:
    """The fields a test can predict, plus whether the timestamps are set."""
    view = pick(receipt, RECEIPT_FIELDS)
    view["forwarded"] = receipt.get("forwarded_at") is not None
    view["completed"] = receipt.get("completed_at") is not None
    return view


def stale_problem(result: CallResult, current_fence: int) -> dict[str, Any]:
    """The problem's identifying fields, and whether it leaks the current owner's token."""
    body = problem(result)
    texts = " ".join(str(body.get(k, "")) for k in ("title", "detail"))
    leaks = re.search(rf"\b{current_fence}\b", texts) is not None or any(
        value in (current_fence, str(current_fence))
        for key, value in body.items()
        if key != "status"
    )
    return pick(body, ("type", "status", "code", "resource", "fence")) | {
        "reveals_current_fence": leaks
    }


def expected_stale(resource: str, fence: int) -> dict[str, Any]:
    return {
        "type": "urn:fence-gateway:stale_fence",
        "status": 409,
        "code": "stale_fence",
        "resource": resource,
        "fence": fence,
        "reveals_current_fence": False,
    }


class TestPausedOwnerIsFencedOut:
    """The seed's failure-injection sequence: A holds token 1 and pauses before its side effect,
    B acts with token 2, A resumes with token 1 and is rejected before reaching the tool."""

    async def _race(
        self,
        variant: str,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
    ) -> None:
        gateway = await gateway_factory(make_policy(upstream.url, [{"match": "run/*"}]))
        resource = "run/seed-1"
        target = "/tool/side-effect?step=charge"
        body = b'{"charge": 100}'
        b_answer = asyncio.Event()
        if variant == "delayed_b_response":
            upstream.script("/api/side-effect", Behavior(gate=b_answer))

        a_paused = asyncio.Event()
        a_resume = asyncio.Event()
        a_copies = 2 if variant == "duplicated_a_request" else 1

        async def worker_a() -> list[CallResult]:
            headers = fenced_headers(resource, 1, owner="worker-a")
            a_paused.set()  # token 1 in hand, side effect prepared, and then the pause
            await a_resume.wait()
            return await asyncio.gather(
                *(
                    call(session, "POST", gateway.url + target, data=body, headers=headers)
                    for _ in range(a_copies)
                )
            )

        task_a = asyncio.create_task(worker_a())
        await a_paused.wait()
        task_b = asyncio.create_task(
            call(
                session,
                "POST",
                gateway.url + target,
                data=body,
                headers=fenced_headers(resource, 2, owner="worker-b"),
            )
        )
        if variant == "delayed_b_response":
            await upstream.wait_received(1)
            a_resume.set()
            a_results = await asyncio.wait_for(task_a, 10)
            b_still_in_flight = not task_b.done()
            b_answer.set()
            b_result = await asyncio.wait_for(task_b, 10)
            assert b_still_in_flight, "A's stale call must be answered while B's is in flight"
        else:
            b_result = await asyncio.wait_for(task_b, 10)
            a_resume.set()
            a_results = await asyncio.wait_for(task_a, 10)

        # B acted; every copy of A was fenced out with a problem+json stale_fence.
        assert b_result.status == 200, b_result
        assert b_result.headers is not None
        assert b_result.headers.get("X-Fence-Token") == "2"
        assert [stale_problem(a, current_fence=2) for a in a_results] == [
            expected_stale(resource, 1)
        ] * a_copies

        # The tool saw exactly one side effect, carrying fence 2.
        seen = [(r.method, r.path_qs, r.fence, r.resource, r.body) for r in upstream.requests]
        assert seen == [("POST", "/api/side-effect?step=charge", 2, resource, body)]
        forwarded = upstream.requests[0]

        # Receipts: B succeeded, each A rejected with stale_fence; in creation order.
        receipts = await fetch_receipts(session, gateway.url, resource=resource)
        key = forwarded.headers.get("Idempotency-Key")
        common = {
            "resource": resource,
            "client": None,
            "upstream": "tool",
            "method": "POST",
            "path": "/side-effect?step=charge",
            "error": None,
            "late": False,
            "resolution": None,
            "completed": True,
        }
        b_expected = common | {
            "fence": 2,
            "owner": "worker-b",
            "idempotency_key": key,
            "fingerprint": "<checked below>",
            "attempt": 1,
            "status": "succeeded",
            "http_status": 200,
            "reject_code": None,
            "forwarded": True,
        }
        a_expected = common | {
            "fence": 1,
            "owner": "worker-a",
            "idempotency_key": None,
            "fingerprint": None,
            "attempt": None,
            "status": "rejected",
            "http_status": 409,
            "reject_code": "stale_fence",
            "forwarded": False,
        }
        views = [receipt_view(r) for r in sorted(receipts, key=lambda r: r["id"])]
        fingerprint = views[0]["fingerprint"] if views else None
        if views:
            views[0]["fingerprint"] = "<checked below>"
        assert views == [b_expected] + [a_expected] * a_copies

        # The receipt B's client and the tool were told about is that receipt.
        b_receipt = min(receipts, key=lambda r: r["id"])
        assert b_result.headers.get("X-Receipt-Id") == b_receipt["id"]
        assert forwarded.headers.get("X-Receipt-Id") == b_receipt["id"]

        # docs/contract.md §4: derived key and fingerprint over method, target (mount included),
        # body.
        digest_input = f"POST\n{target}\n".encode() + body
        assert fingerprint == "sha256:" + hashlib.sha256(digest_input).hexdigest()
        derived = hashlib.sha256(f"{resource}\n".encode() + digest_input).hexdigest()[:32]
        assert key == "gw-" + derived

    async def test_stale_owner_resumes_after_new_owner_acted(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        await self._race("plain", upstream, gateway_factory, session)

    async def test_stale_call_arrives_while_new_owners_call_is_in_flight(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        await self._race("delayed_b_response", upstream, gateway_factory, session)

    async def test_stale_owner_sends_its_side_effect_twice(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        await self._race("duplicated_a_request", upstream, gateway_factory, session)


class TestShuffledFences:
    """Fifty concurrent calls with tokens 1..50 in random order on one resource (parallel mode):
    no call is admitted with a fence lower than one admitted before it."""

    async def test_no_admitted_fence_goes_backwards(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await gateway_factory(
            make_policy(upstream.url, [{"match": "race/*", "queue_timeout_s": 20}])
        )
        upstream.default = Behavior(delay=0.08)
        resource = "race/r1"
        # This seed's shuffle gives every burst (below) a token higher than all earlier bursts
        # and at least three tokens above them: each burst has calls to admit and to race.
        rng = random.Random(20324424)
        fences = list(range(1, 51))
        rng.shuffle(fences)
        # Five bursts of ten, 0.3 s apart: within a burst the calls race each other (a higher
        # fence arrives while a lower one is in flight), and across bursts earlier calls have
        # completed before later ones are invoked.
        stagger = {f: (i // 10) * 0.3 + rng.uniform(0, 0.01) for i, f in enumerate(fences)}

        async def one(fence: int) -> CallResult:
            await asyncio.sleep(stagger[fence])
            return await call(
                session,
                "POST",
                f"{gateway.url}/tool/op",
                label=fence,
                data=f'{{"call": {fence}}}'.encode(),
                headers=fenced_headers(resource, fence, owner=f"worker-{fence}"),
            )

        results = await asyncio.wait_for(asyncio.gather(*(one(f) for f in fences)), 30)
        by_fence = {r.label: r for r in results}

        outcomes = {}
        for r in results:
            outcomes[r.label] = 200 if r.status == 200 else (r.status, problem(r).get("code"))
        admitted = sorted(f for f, o in outcomes.items() if o == 200)
        rejected = sorted(f for f, o in outcomes.items() if o != 200)
        assert {f: outcomes[f] for f in rejected} == {f: (409, "stale_fence") for f in rejected}
        assert 50 in admitted, "the highest token can never be stale"

        # The tool saw each admitted call exactly once, and its fences never went down.
        upstream_fences = [r.fence for r in sorted(upstream.requests, key=lambda r: r.seq)]
        assert sorted(upstream_fences) == admitted
        assert upstream_fences == sorted(upstream_fences)

        # Takeover ordering: a call reached the tool only after every lower fence had finished.
        overlaps = [
            (low.fence, high.fence)
            for high in upstream.requests
            for low in upstream.requests
            if low.fence < high.fence and low.completed_at > high.received_at
        ]
        assert overlaps == []

        # Client-side: X completed before Y was invoked, both admitted => fence(X) <= fence(Y).
        sequential = [
            (x, y)
            for x in admitted
            for y in admitted
            if by_fence[x].completed_at < by_fence[y].invoked_at
        ]
        assert sequential, "the bursts did not produce any call admitted after another ended"
        assert [(x, y) for x, y in sequential if x > y] == []

        # A rejected call had a higher fence admitted before it completed (client clocks) ...
        unexplained = [
            f
            for f in rejected
            if not any(
                a > f and by_fence[a].invoked_at < by_fence[f].completed_at for a in admitted
            )
        ]
        assert unexplained == []

        # ... and in the store: receipts in creation (id) order never lower an admitted fence,
        # and each rejected receipt follows an admitted one with a higher fence.
        receipts = sorted(
            await fetch_receipts(session, gateway.url, resource=resource), key=lambda r: r["id"]
        )
        assert {r["fence"]: r["status"] for r in receipts} == {
            f: ("succeeded" if f in admitted else "rejected") for f in fences
        }
        assert {r["fence"]: r["reject_code"] for r in receipts if r["status"] == "rejected"} == {
            f: "stale_fence" for f in rejected
        }
        highest = 0
        out_of_order = []
        for r in receipts:
            if r["status"] == "rejected":
                if r["fence"] >= highest:
                    out_of_order.append(("rejected without a higher admitted fence", r["fence"]))
            else:
                if r["fence"] < highest:
                    out_of_order.append(("admitted below an earlier admitted fence", r["fence"]))
                highest = max(highest, r["fence"])
        assert out_of_order == []
