"""Gateway-issued leases end to end: a real gateway process, a real upstream, real SQLite.

docs/contract.md §6 (acquire CAS, fences that survive anything), §3 step 4 for
`issuer: gateway` (forged, stale, expired and mismatched tokens) and §9 (the sweeper's cleanup
call).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from gateway.core.times import parse_rfc3339
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

API = "/_gateway/v1/leases"
GATEWAY_LEASE = {"issuer": "gateway", "ttl_s": 1, "max_ttl_s": 10}


def policy(upstream: RecordingUpstream) -> dict[str, Any]:
    return make_policy(
        upstream.url,
        [
            {"match": "run/*", "lease": GATEWAY_LEASE},
            {
                "match": "browser/*",
                "lease": GATEWAY_LEASE | {"ttl_s": 0.5},
                "on_expiry": {"method": "DELETE", "path": "/sessions/{name}"},
            },
        ],
        timeout_s=3,
    )


async def acquire(
    session: aiohttp.ClientSession,
    url: str,
    resource: str,
    owner: str,
    ttl_s: float | None = None,
    key: str | None = None,
) -> CallResult:
    body: dict[str, Any] = {"owner": owner}
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    return await call(
        session,
        "POST",
        f"{url}{API}/{resource}",
        json=body,
        label=owner,
        headers={"Idempotency-Key": key} if key else {},
    )


async def fenced_post(
    session: aiohttp.ClientSession,
    url: str,
    resource: str,
    fence: int,
    owner: str | None = None,
    path: str = "/tool/side-effect",
) -> CallResult:
    return await call(
        session,
        "POST",
        url + path,
        data=b'{"charge": 100}',
        headers=fenced_headers(resource, fence, owner=owner),
    )


def code_of(result: CallResult) -> tuple[int | None, str]:
    return result.status, problem(result)["code"]


async def cleanups_metric(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/_gateway/metrics") as resp:
        text = await resp.text()
    found = {}
    for line in text.splitlines():
        if line.startswith("fence_gateway_sweeper_cleanups_total{"):
            labels, value = line.rsplit(" ", 1)
            if float(value):  # every result is exported from 0 (for the alert's increase())
                found[labels.split('result="')[1].split('"')[0]] = float(value)
    return found


class TestAcquireRace:
    """N concurrent acquires of one free resource: exactly one 201."""

    async def test_30_concurrent_acquires_give_one_lease(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
    ) -> None:
        gateway = await gateway_factory(policy(upstream))
        results = await asyncio.gather(
            *(
                acquire(session, gateway.url, "run/contested", f"worker-{i}", ttl_s=5)
                for i in range(30)
            )
        )
        winners = [r for r in results if r.status == 201]
        assert len(winners) == 1, [(r.status, r.body[:80]) for r in results]
        lease = winners[0].json()
        assert (lease["fence"], lease["owner"]) == (1, winners[0].label)
        for loser in (r for r in results if r.status != 201):
            body = problem(loser)
            assert pick(body, ("status", "code", "holder", "expires_at")) == {
                "status": 409,
                "code": "lease_held",
                "holder": lease["owner"],
                "expires_at": lease["expires_at"],
            }
            assert loser.headers is not None and int(loser.headers["Retry-After"]) in (4, 5)

    async def test_a_keyed_retry_gets_the_same_lease_the_name_alone_does_not(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
    ) -> None:
        gateway = await gateway_factory(policy(upstream))
        first = await acquire(session, gateway.url, "run/a", "run-8f21", key="attempt-1")
        retried = await acquire(session, gateway.url, "run/a", "run-8f21", key="attempt-1")
        same_name = await acquire(session, gateway.url, "run/a", "run-8f21")
        assert (first.status, retried.status) == (201, 200)
        assert retried.json() == first.json()
        assert code_of(same_name) == (409, "lease_held")
        assert problem(same_name)["holder"] == "run-8f21"


class TestFencesSurviveCrashes:
    """A fence is never reused: not after kill -9, not after expiry, not after release."""

    async def test_kill_9_and_restart(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
    ) -> None:
        gateway = await gateway_factory(policy(upstream))
        first = (await acquire(session, gateway.url, "run/k", "worker-a", ttl_s=0.5)).json()
        assert first["fence"] == 1
        assert (await fenced_post(session, gateway.url, "run/k", 1)).status == 200
        await gateway.kill9()
        await gateway.restart()
        # the acquire was durable: the lease is there, and it stays held until it expires
        async with session.get(f"{gateway.url}{API}/run/k") as resp:
            assert pick(await resp.json(), ("owner", "fence")) == {"owner": "worker-a", "fence": 1}
        await asyncio.sleep(max(0.0, _until(first["expires_at"])) + 0.05)
        second = await acquire(session, gateway.url, "run/k", "worker-b")
        assert (second.status, second.json()["fence"]) == (201, 2)
        released = await call(
            session,
            "DELETE",
            f"{gateway.url}{API}/run/k",
            params={"owner": "worker-b", "fence": "2"},
        )
        assert released.status == 204
        await gateway.kill9()
        await gateway.restart()
        third = await acquire(session, gateway.url, "run/k", "worker-c")
        assert (third.status, third.json()["fence"]) == (201, 3)
        # the old tokens stay dead after the restarts
        assert code_of(await fenced_post(session, gateway.url, "run/k", 1)) == (409, "stale_fence")
        # (another call than the first: the same one would be a replay, §4)
        assert (
            await fenced_post(session, gateway.url, "run/k", 3, path="/tool/second-step")
        ).status == 200
        assert [(r.path, r.fence) for r in upstream.requests] == [
            ("/api/side-effect", 1),
            ("/api/second-step", 3),
        ]


class TestSeedRaceWithGatewayLeases:
    """The seed's sequence with the gateway as issuer: A pauses past its TTL, B takes over
    and acts, A resumes and is fenced out, A's renewal is refused."""

    async def test_paused_owner_is_fenced_out(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
    ) -> None:
        gateway = await gateway_factory(policy(upstream))
        resource = "run/seed-1"
        a = (await acquire(session, gateway.url, resource, "worker-a", ttl_s=0.4)).json()
        await asyncio.sleep(0.5)  # A pauses (GC, swap, partition) past its TTL
        b_acquired = await acquire(session, gateway.url, resource, "worker-b", ttl_s=5)
        assert b_acquired.status == 201
        b = b_acquired.json()
        assert b["fence"] > a["fence"]
        b_call = await fenced_post(session, gateway.url, resource, b["fence"], "worker-b")
        assert b_call.status == 200
        a_call = await fenced_post(session, gateway.url, resource, a["fence"], "worker-a")
        assert pick(problem(a_call), ("code", "resource", "fence")) == {
            "code": "stale_fence",
            "resource": resource,
            "fence": a["fence"],
        }
        a_renew = await call(
            session,
            "PUT",
            f"{gateway.url}{API}/{resource}",
            json={"owner": "worker-a", "fence": a["fence"]},
        )
        assert code_of(a_renew) == (409, "lease_lost")

        assert [(r.method, r.path, r.fence, r.resource) for r in upstream.requests] == [
            ("POST", "/api/side-effect", b["fence"], resource)
        ]
        receipts = await fetch_receipts(session, gateway.url, resource=resource)
        assert [
            pick(r, ("fence", "owner", "status", "reject_code", "http_status")) for r in receipts
        ] == [
            {
                "fence": b["fence"],
                "owner": "worker-b",
                "status": "succeeded",
                "reject_code": None,
                "http_status": 200,
            },
            {
                "fence": a["fence"],
                "owner": "worker-a",
                "status": "rejected",
                "reject_code": "stale_fence",
                "http_status": 409,
            },
        ]


class TestGatewayFenceChecks:
    """§3 step 4 for issuer gateway: forged, expired and mismatched tokens."""

    async def test_a_forged_fence_moves_nothing_and_reaches_nothing(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
    ) -> None:
        gateway = await gateway_factory(policy(upstream))
        lease = (await acquire(session, gateway.url, "run/f", "worker-a", ttl_s=5)).json()
        forged = await fenced_post(session, gateway.url, "run/f", 1_000_000)
        assert pick(problem(forged), ("status", "code", "fence")) == {
            "status": 403,
            "code": "fence_not_issued",
            "fence": 1_000_000,
        }
        assert upstream.requests == []
        real = await fenced_post(session, gateway.url, "run/f", lease["fence"], "worker-a")
        assert real.status == 200
        assert [r.fence for r in upstream.requests] == [lease["fence"]]
        # nor did it move what the next owner gets
        await call(session, "DELETE", f"{gateway.url}{API}/run/f", params={"force": "true"})
        nxt = (await acquire(session, gateway.url, "run/f", "worker-b")).json()
        assert nxt["fence"] == lease["fence"] + 1
        receipts = await fetch_receipts(session, gateway.url, resource="run/f")
        assert [(r["fence"], r["status"], r["reject_code"]) for r in receipts] == [
            (1_000_000, "rejected", "fence_not_issued"),
            (1, "succeeded", None),
        ]

    async def test_the_current_fence_after_expiry_or_release_is_lease_expired(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
    ) -> None:
        gateway = await gateway_factory(policy(upstream))
        expiring = (await acquire(session, gateway.url, "run/e", "worker-a", ttl_s=0.3)).json()
        await asyncio.sleep(0.4)
        assert code_of(await fenced_post(session, gateway.url, "run/e", expiring["fence"])) == (
            409,
            "lease_expired",
        )
        released = (await acquire(session, gateway.url, "run/r", "worker-a")).json()
        await call(
            session,
            "DELETE",
            f"{gateway.url}{API}/run/r",
            params={"owner": "worker-a", "fence": str(released["fence"])},
        )
        assert code_of(await fenced_post(session, gateway.url, "run/r", released["fence"])) == (
            409,
            "lease_expired",
        )
        assert upstream.requests == []

    async def test_another_owner_name_is_owner_mismatch(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
    ) -> None:
        gateway = await gateway_factory(policy(upstream))
        lease = (await acquire(session, gateway.url, "run/o", "worker-a", ttl_s=5)).json()
        mismatch = await fenced_post(session, gateway.url, "run/o", lease["fence"], "worker-b")
        assert code_of(mismatch) == (409, "owner_mismatch")
        assert upstream.requests == []
        assert (await fenced_post(session, gateway.url, "run/o", lease["fence"])).status == 200


class TestSweeperCleanup:
    """§9: after expiry the sweeper calls `on_expiry` under a newer fence of its own."""

    async def test_the_cleanup_fences_out_the_expired_owner(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
    ) -> None:
        gateway = await gateway_factory(policy(upstream), sweep_interval_s=0.1)
        lease = (
            await acquire(session, gateway.url, "browser/acct-7", "worker-a", ttl_s=0.3)
        ).json()
        assert (
            await fenced_post(
                session,
                gateway.url,
                "browser/acct-7",
                lease["fence"],
                "worker-a",
                path="/tool/sessions/acct-7/click",
            )
        ).status == 200
        await upstream.wait_received(1, method="DELETE", timeout=5)
        [cleanup] = upstream.received(method="DELETE")
        assert cleanup.path == "/api/sessions/acct-7"
        assert cleanup.fence is not None and cleanup.fence > lease["fence"]
        assert cleanup.headers["Idempotency-Key"] == f"gw-sweep-{cleanup.fence}"
        assert cleanup.resource == "browser/acct-7"
        late = await fenced_post(
            session,
            gateway.url,
            "browser/acct-7",
            lease["fence"],
            "worker-a",
            path="/tool/sessions/acct-7/click",
        )
        assert code_of(late) == (409, "stale_fence")
        assert len(upstream.received(method="POST")) == 1
        deadline = time.monotonic() + 5
        while (
            await cleanups_metric(session, gateway.url) != {"succeeded": 1.0}
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.05)
        assert await cleanups_metric(session, gateway.url) == {"succeeded": 1.0}
        receipts = await fetch_receipts(session, gateway.url, resource="browser/acct-7")
        assert [
            (r["method"], r["fence"], r["status"], r["owner"].split(":")[0]) for r in receipts
        ] == [
            ("POST", lease["fence"], "succeeded", "worker-a"),
            ("DELETE", cleanup.fence, "succeeded", "gateway-sweeper"),
            ("POST", lease["fence"], "rejected", "worker-a"),
        ]

    async def test_a_failing_cleanup_is_retried_at_a_later_sweep(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
    ) -> None:
        gateway = await gateway_factory(policy(upstream), sweep_interval_s=0.1)
        answers = iter([Behavior(status=502), Behavior(status=200)])
        upstream.script("/api/sessions/acct-8", lambda _rec: next(answers))
        await acquire(session, gateway.url, "browser/acct-8", "worker-a", ttl_s=0.3)
        await upstream.wait_received(2, method="DELETE", timeout=5)
        first, second = upstream.received(method="DELETE")
        assert first.fence is not None and second.fence is not None
        assert second.fence > first.fence > 1
        deadline = time.monotonic() + 5
        while (
            await cleanups_metric(session, gateway.url) != {"failed": 1.0, "succeeded": 1.0}
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.05)
        assert await cleanups_metric(session, gateway.url) == {"failed": 1.0, "succeeded": 1.0}
        assert "cleanup_failed" in gateway.stderr_text()
        await asyncio.sleep(0.3)
        assert len(upstream.received(method="DELETE")) == 2


def _until(expires_at: str) -> float:
    """Seconds until an RFC 3339 time (the gateway's clock is this machine's)."""
    return parse_rfc3339(expires_at) - time.time()
