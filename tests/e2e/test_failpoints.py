"""Crashes and store failures at the exact points docs/contract.md §3 reasons about, via
GATEWAY_FAILPOINTS.

§11 (`after_admit`, `after_upstream`, `in_commit` with `crash` or `error`),
§3 (step 6 fails closed; "Outcome": a lost outcome write still answers, with
`X-Receipt-Outcome: unrecorded`, and the receipt stays `pending`) and §9 (recovery
turns every `pending` receipt of an earlier run `outcome_unknown`; the sweeper turns one
older than `timeout_s` + `GATEWAY_RECONCILE_GRACE_S` `outcome_unknown`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.harness import (
    Behavior,
    GatewayFactory,
    GatewayProcess,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    make_policy,
    pick,
    problem,
    wait_for,
    write_policy,
)

RESOURCE = "fp/r1"


def policy(upstream: RecordingUpstream, **options: Any) -> dict[str, Any]:
    return make_policy(upstream.url, [{"match": "fp/**"}], **options)


async def receipts_of(session: aiohttp.ClientSession, gateway: GatewayProcess) -> list[dict]:
    return await fetch_receipts(session, gateway.url, resource=RESOURCE)


async def wait_exit(gateway: GatewayProcess, timeout: float = 5.0) -> int:
    await wait_for(lambda: gateway.returncode is not None, timeout=timeout, what="exit")
    code = gateway.returncode
    assert code is not None
    return code


FIELDS = ("resource", "fence", "method", "path", "status", "http_status", "reject_code")


class TestCrashes:
    async def test_crash_after_admit_forwards_nothing_and_recovers_outcome_unknown(
        self, upstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await gateway_factory(
            policy(upstream), extra_env={"GATEWAY_FAILPOINTS": "after_admit=crash"}
        )
        lost = await call(
            session,
            "POST",
            f"{gateway.url}/tool/pay",
            data=b'{"amount": 5}',
            headers=fenced_headers(RESOURCE, 3),
        )
        assert lost.status is None, "the process died before answering"
        assert await wait_exit(gateway) != 0
        await asyncio.sleep(0.2)  # anything still on its way to the tool would show by now
        assert upstream.requests == []

        gateway.extra_env.pop("GATEWAY_FAILPOINTS")
        await gateway.restart()
        receipts = await receipts_of(session, gateway)
        assert [pick(r, FIELDS) for r in receipts] == [
            {
                "resource": RESOURCE,
                "fence": 3,
                "method": "POST",
                "path": "/pay",
                "status": "outcome_unknown",
                "http_status": None,
                "reject_code": None,
            }
        ]
        # The committed fence survived the crash: an older token is stale now.
        stale = await call(
            session,
            "POST",
            f"{gateway.url}/tool/pay",
            data=b"{}",
            headers=fenced_headers(RESOURCE, 2),
        )
        assert problem(stale)["code"] == "stale_fence"
        assert upstream.requests == []

    async def test_crash_after_upstream_answered_recovers_outcome_unknown(
        self, upstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await gateway_factory(
            policy(upstream), extra_env={"GATEWAY_FAILPOINTS": "after_upstream=crash"}
        )
        lost = await call(
            session,
            "POST",
            f"{gateway.url}/tool/pay",
            data=b'{"amount": 7}',
            headers=fenced_headers(RESOURCE, 4),
        )
        assert lost.status is None, "the process died before answering"
        assert await wait_exit(gateway) != 0
        assert [(r.method, r.path, r.fence) for r in upstream.requests] == [("POST", "/api/pay", 4)]

        gateway.extra_env.pop("GATEWAY_FAILPOINTS")
        await gateway.restart()
        receipts = await receipts_of(session, gateway)
        assert [pick(r, FIELDS) for r in receipts] == [
            {
                "resource": RESOURCE,
                "fence": 4,
                "method": "POST",
                "path": "/pay",
                "status": "outcome_unknown",
                "http_status": None,
                "reject_code": None,
            }
        ]
        assert receipts[0]["id"] == upstream.requests[0].headers["X-Receipt-Id"]
        assert await fetch_receipts(session, gateway.url, status="pending") == []
        assert len(upstream.requests) == 1, "nothing was resent on restart"


class TestStoreErrors:
    async def test_unrecorded_outcome_still_answers_and_the_sweeper_turns_it_unknown(
        self, upstream, gateway_factory: GatewayFactory, session
    ) -> None:
        timeout_s, grace_s = 1.0, 0.5
        upstream.default = Behavior(
            status=201, body=b'{"id": "op-1"}', headers={"Content-Type": "application/json"}
        )
        gateway = await gateway_factory(
            policy(upstream, timeout_s=timeout_s),
            extra_env={
                "GATEWAY_FAILPOINTS": "after_upstream=error",
                "GATEWAY_RECONCILE_GRACE_S": str(grace_s),
            },
            # the process counts as silent after 3 intervals: 0.75 s, so that a loaded machine's
            # late heartbeat does not make the receipt lost before its timeout and grace
            sweep_interval_s=0.25,
        )
        url = f"{gateway.url}/tool/create"
        headers = fenced_headers(RESOURCE, 1)
        invoked = time.monotonic()
        result = await call(session, "POST", url, data=b"{}", headers=headers)
        assert result.headers is not None
        assert (result.status, result.body, result.headers.get("X-Receipt-Outcome")) == (
            201,
            b'{"id": "op-1"}',
            "unrecorded",
        )
        receipt_id = result.headers["X-Receipt-Id"]
        (receipt,) = await receipts_of(session, gateway)
        assert pick(receipt, ("id", "status", "http_status")) == {
            "id": receipt_id,
            "status": "pending",
            "http_status": None,
        }
        # Pending means in flight as far as idempotency knows: the same call is not resent.
        again = await call(session, "POST", url, data=b"{}", headers=headers)
        assert pick(problem(again), ("status", "code", "receipt_id")) == {
            "status": 409,
            "code": "idempotency_in_flight",
            "receipt_id": receipt_id,
        }

        unknown: list[dict[str, Any]] = []
        for _ in range(100):
            unknown = await fetch_receipts(session, gateway.url, status="outcome_unknown")
            if unknown:
                break
            await asyncio.sleep(0.05)
        seen_unknown_at = time.monotonic()
        assert [r["id"] for r in unknown] == [receipt_id]
        # Not before timeout_s + grace after it was sent (small slack for clock reads).
        assert seen_unknown_at - invoked >= timeout_s + grace_s - 0.05
        assert len(upstream.requests) == 1


class HealthzGateway(GatewayProcess):
    """A gateway that counts as started once `/_gateway/healthz` answers.

    The harness waits for `readyz`, which must stay 503 while the store refuses writes.
    """

    ready_path = "/_gateway/healthz"


@pytest.fixture
async def healthz_gateways() -> AsyncIterator[list[HealthzGateway]]:
    """Append each `HealthzGateway` you make; they are killed on teardown."""
    started: list[HealthzGateway] = []
    yield started
    for gateway in started:
        gateway.kill9_sync()


class TestCommitFailure:
    async def test_a_commit_that_fails_answers_503_and_forwards_nothing(
        self, upstream, tmp_path, healthz_gateways, session
    ) -> None:
        policy_path = write_policy(tmp_path / "policies.yaml", policy(upstream))
        gateway = HealthzGateway(
            tmp_path,
            policy_path,
            sweep_interval_s=0.2,
            extra_env={"GATEWAY_FAILPOINTS": "in_commit=error"},
        )
        healthz_gateways.append(gateway)
        await gateway.start()

        result = await call(
            session,
            "POST",
            f"{gateway.url}/tool/pay",
            data=b"{}",
            headers=fenced_headers(RESOURCE, 1),
        )
        assert pick(problem(result), ("status", "code")) == {
            "status": 503,
            "code": "store_unavailable",
        }
        ready = await call(session, "GET", f"{gateway.url}/_gateway/readyz")
        assert ready.status == 503
        assert upstream.requests == []
        assert gateway.returncode is None
