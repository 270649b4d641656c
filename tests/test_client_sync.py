"""`SyncGatewayClient` against the small real gateway of test_client_unit (docs/contract.md
§20): the same acquire, renewal on a background thread, the same LeaseLost before anything is
sent. The fake runs on the test's event loop; the synchronous code runs in a worker thread, as
it would in a program with no event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from gateway.client import (
    RENEW_JITTER,
    GatewayError,
    LeaseHeld,
    LeaseLost,
    SyncGatewayClient,
    SyncLease,
)
from tests.test_client_unit import LEASE_PATH, RESOURCE, FakeGateway, start_fake

T = TypeVar("T")


async def off_loop(fn: Callable[[], T]) -> T:
    return await asyncio.to_thread(fn)


@pytest.fixture
async def fake(aiohttp_server: Any) -> FakeGateway:
    return await start_fake(aiohttp_server)


class TestRenewalThread:
    """A held lease renews itself on a thread, at about a third of its TTL, with jitter."""

    async def test_renews_in_the_background_and_stays_usable(self, fake: FakeGateway) -> None:
        def run() -> tuple[int, bool, list[str]]:
            with (
                SyncGatewayClient(fake.url, key="sekret") as gw,
                gw.lease(RESOURCE, owner="run-1", ttl_s=0.6) as lease,
            ):
                time.sleep(0.9)  # a slow model call: no event loop, the thread renews
                lost = lease.lost
                status = lease.post("/tool/send", json={"text": "hi"}).status
                names = [t.name for t in threading.enumerate()]
            return status, lost, names

        status, lost, names = await off_loop(run)
        assert (status, lost) == (200, False)
        assert f"renew {RESOURCE}" in names
        acquired, renewals = fake.of("POST", LEASE_PATH)[0], fake.of("PUT", LEASE_PATH)
        assert 3 <= len(renewals) <= 5
        assert all(r.body == {"owner": "run-1", "fence": 1, "ttl_s": 0.6} for r in renewals)
        gaps = [b.at - a.at for a, b in zip([acquired, *renewals], renewals, strict=False)]
        assert all(
            0.2 * (1 - RENEW_JITTER) - 0.02 <= g <= 0.2 * (1 + RENEW_JITTER) + 0.1 for g in gaps
        ), gaps
        [call] = fake.of("POST", "/tool/send")
        assert call.headers["X-Fence-Token"] == "1"
        assert call.headers["Proxy-Authorization"] == "Bearer sekret"
        assert acquired.headers["Authorization"] == "Bearer sekret"
        [release] = fake.of("DELETE", LEASE_PATH)
        assert release.query == {"owner": "run-1", "fence": "1"}

    async def test_release_stops_the_thread(self, fake: FakeGateway) -> None:
        def run() -> SyncLease:
            with SyncGatewayClient(fake.url) as gw, gw.lease(RESOURCE, "run-1", 30) as lease:
                pass
            return lease

        lease = await off_loop(run)
        assert lease.lost_reason == "released"
        assert not any(t.name == f"renew {RESOURCE}" for t in threading.enumerate())


class TestLeaseLost:
    """Once lost, a fenced call, a checkpoint and `auth()` raise LeaseLost; nothing is sent."""

    async def test_a_refused_renewal_marks_the_lease_lost(self, fake: FakeGateway) -> None:
        def run() -> tuple[str | None, LeaseLost]:
            with SyncGatewayClient(fake.url) as gw, gw.lease(RESOURCE, "run-1", 0.6) as lease:
                fake.renew_status = 409
                time.sleep(0.35)
                reason, before = lease.lost_reason, len(fake.seen)
                with pytest.raises(LeaseLost) as caught:
                    lease.post("/tool/send", json={"text": "hi"})
                with pytest.raises(LeaseLost):
                    lease.checkpoint("step", {})
                with pytest.raises(LeaseLost):
                    lease.mcp_meta()
                assert len(fake.seen) == before
            return reason, caught.value

        reason, lost = await off_loop(run)
        assert reason == "renewal refused: lease_lost"
        assert (lost.status, lost.code) == (None, "lease_lost")
        assert fake.of("POST", "/tool/send") == []
        assert fake.of("DELETE") == []  # the gateway already said it is gone

    async def test_failing_renewals_lose_it_at_the_local_deadline(self, fake: FakeGateway) -> None:
        def run() -> tuple[bool, str | None]:
            with SyncGatewayClient(fake.url) as gw, gw.lease(RESOURCE, "run-1", 0.5) as lease:
                fake.renew_status = 503
                time.sleep(0.3)
                early = lease.lost  # a transient failure is not a loss, the deadline is
                time.sleep(0.3)
                return early, lease.lost_reason

        early, reason = await off_loop(run)
        assert not early and reason == "expired: no successful renewal within the TTL"
        assert len(fake.of("PUT", LEASE_PATH)) >= 4  # retried sooner as the deadline neared

    async def test_a_stale_fence_answer_marks_it_lost(self, fake: FakeGateway) -> None:
        def run() -> tuple[LeaseLost, str | None]:
            with SyncGatewayClient(fake.url) as gw, gw.lease(RESOURCE, "run-1", 30) as lease:
                fake.hold(RESOURCE, "run-2", 30)  # taken over behind the client's back
                with pytest.raises(LeaseLost) as caught:
                    lease.put("/tool/send")
                with pytest.raises(LeaseLost):
                    lease.put("/tool/send")
                return caught.value, lease.lost_reason

        lost, reason = await off_loop(run)
        assert (lost.status, lost.code) == (409, "stale_fence")
        assert reason == "gateway refused a fenced call: stale_fence"
        assert len(fake.of("PUT", "/tool/send")) == 1


class TestFencedCalls:
    """Upstream answers come back as values; only the gateway's own problems raise."""

    async def test_an_upstream_error_is_returned_not_raised(self, fake: FakeGateway) -> None:
        def run() -> tuple[int, str, bool, int]:
            with SyncGatewayClient(fake.url) as gw, gw.lease(RESOURCE, "run-1", 30) as lease:
                missing = lease.delete("/tool/missing")
                found = lease.get("/tool/thing", params={"q": "a b"})
                return missing.status, missing.text(), lease.lost, found.status

        assert await off_loop(run) == (404, "no such thing", False, 200)
        [get] = fake.of("GET", "/tool/thing")
        assert get.query == {"q": "a b"} and get.headers["X-Fence-Token"] == "1"


class TestAcquire:
    """The same polite acquire as the async client: LeaseHeld, Retry-After, a lost answer."""

    async def test_gives_up_with_lease_held(self, fake: FakeGateway) -> None:
        fake.hold(RESOURCE, "run-old", 30)

        def run() -> None:
            SyncGatewayClient(fake.url).lease(RESOURCE, "run-1", acquire_timeout_s=0.3).acquire()

        with pytest.raises(LeaseHeld) as caught:
            await off_loop(run)
        held = caught.value
        assert (held.status, held.holder, held.retry_after) == (409, "run-old", 30.0)
        assert len(fake.of("POST", LEASE_PATH)) == 2

    async def test_waits_for_retry_after_then_takes_over(self, fake: FakeGateway) -> None:
        fake.hold(RESOURCE, "run-old", 0.4)

        def run() -> tuple[int, float]:
            started = time.monotonic()
            with (
                SyncGatewayClient(fake.url) as gw,
                gw.lease(RESOURCE, "run-1", 5, acquire_timeout_s=5) as lease,
            ):
                return lease.fence, time.monotonic() - started

        fence, elapsed = await off_loop(run)
        assert fence == 2 and 1.0 <= elapsed < 1.25 + 0.3
        first, second = fake.of("POST", LEASE_PATH)
        assert first.headers["Idempotency-Key"] != second.headers["Idempotency-Key"]

    async def test_a_lost_answer_is_retried_with_the_same_key(self, fake: FakeGateway) -> None:
        fake.drop_first_acquire = True

        def run() -> int:
            with SyncGatewayClient(fake.url) as gw, gw.lease(RESOURCE, "run-1", 30) as lease:
                return lease.fence

        assert await off_loop(run) == 1
        first, second = fake.of("POST", LEASE_PATH)
        assert first.headers["Idempotency-Key"] == second.headers["Idempotency-Key"]

    async def test_a_refusal_is_not_retried(self, fake: FakeGateway) -> None:
        def run() -> Any:
            return SyncGatewayClient(fake.url).lease("mail/inbox-1", "run-1").acquire()

        with pytest.raises(GatewayError) as caught:
            await off_loop(run)
        assert (type(caught.value), caught.value.code) == (GatewayError, "resource_not_allowed")
        assert len(fake.of("POST")) == 1

    def test_a_body_given_twice_is_refused_before_sending(self) -> None:
        with pytest.raises(TypeError, match="not both"):
            SyncGatewayClient("http://127.0.0.1:9").request("POST", "/x", json={}, data=b"")

    def test_a_base_url_that_is_not_http_is_refused(self) -> None:
        with pytest.raises(ValueError, match="ftp://x"):
            SyncGatewayClient("ftp://x")
