"""The client library's leases at their edges (docs/contract.md §13, §17): renewals
scheduled within the local deadline however late an answer came, a lease object acquired
again and released again, no redirect followed, a refused upgrade read on a shared session,
and no checkpoint resent once the lease is known lost."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.client import GatewayClient, LeaseLost, SyncGatewayClient
from tests.test_client_unit import LEASE_PATH, RESOURCE, FakeGateway, _problem, start_fake


@pytest.fixture
async def fake(aiohttp_server: Any) -> FakeGateway:
    return await start_fake(aiohttp_server)


# -- renewal timing vs the local deadline ------------------------------------------------------


class TestRenewalBeforeTheDeadline:
    """The local deadline counts from when the acquire was sent, so an acquire answered late
    (a slow store, a retry under the same key after a lost answer) leaves less than the TTL:
    the first renewal goes out before that deadline, not a third of the TTL after the answer,
    which gave the lease up without a single renewal tried."""

    async def test_aio_lease_renews_before_its_deadline_after_a_slow_acquire(
        self, fake: FakeGateway
    ) -> None:
        fake.acquire_delay_s = 1.0  # answered 1 s into a 1.2 s TTL
        async with GatewayClient(fake.url) as gw:
            lease = gw.lease(RESOURCE, owner="run-1", ttl_s=1.2)
            await lease.acquire()
            try:
                await asyncio.sleep(0.8)  # past the deadline the acquire's send set
                renewals = fake.of("PUT", LEASE_PATH)
                assert renewals, "no renewal was even tried before the local deadline"
                assert not lease.lost, lease.lost_reason
            finally:
                await lease.release()

    async def test_sync_lease_renews_before_its_deadline_after_a_slow_acquire(
        self, fake: FakeGateway
    ) -> None:
        fake.acquire_delay_s = 1.0

        def run() -> tuple[bool, str | None]:
            with SyncGatewayClient(fake.url) as gw, gw.lease(RESOURCE, "run-1", 1.2) as lease:
                time.sleep(0.8)
                return lease.lost, lease.lost_reason

        lost, reason = await asyncio.to_thread(run)
        assert fake.of("PUT", LEASE_PATH), "no renewal was even tried before the local deadline"
        assert not lost, reason


# -- a lease acquired again after a release ----------------------------------------------------


class TestReacquire:
    """A lease object acquired again after a release is released again on its second exit,
    and from then on says it is lost and sends nothing."""

    async def test_a_lease_acquired_again_is_released_again(self, fake: FakeGateway) -> None:
        async with GatewayClient(fake.url) as gw:
            lease = gw.lease(RESOURCE, owner="run-1", ttl_s=30)
            async with lease:
                pass
            async with lease:
                assert lease.fence == 2
            assert len(fake.of("DELETE", LEASE_PATH)) == 2, "the second release was not sent"
            assert lease.lost, "released, yet the lease still reports itself held"
            before = len(fake.of("POST", "/tool/send"))
            with pytest.raises(LeaseLost):
                await lease.post("/tool/send")
            assert len(fake.of("POST", "/tool/send")) == before

    async def test_sync_lease_acquired_again_is_released_again(self, fake: FakeGateway) -> None:
        def run() -> bool:
            with SyncGatewayClient(fake.url) as gw:
                lease = gw.lease(RESOURCE, owner="run-1", ttl_s=30)
                with lease:
                    pass
                with lease:
                    pass
                return lease.lost

        lost = await asyncio.to_thread(run)
        assert len(fake.of("DELETE", LEASE_PATH)) == 2, "the second release was not sent"
        assert lost


# -- redirects: a fenced call is sent once, to the gateway only ---------------------------------


class TestRedirects:
    """A tool's 307 or 308 is returned, not followed: following it, aiohttp sent the fenced
    side effect again by itself (body, fence headers and Idempotency-Key) to wherever
    `Location` said: another origin (the tool's own address: no fence check, no receipt) or
    the gateway again (a second fenced call the caller never made). The synchronous client
    never follows one either."""

    @pytest.mark.parametrize("where", ["another-origin", "same-gateway"])
    async def test_a_fenced_call_is_not_resent_to_a_redirect_s_location(
        self, fake: FakeGateway, where: str
    ) -> None:
        if where == "another-origin":
            target = fake.url.replace("127.0.0.1", "localhost") + "/tool/send"
        else:
            target = "/tool/send"
        async with (
            GatewayClient(fake.url, key="sekret") as gw,
            gw.lease(RESOURCE, owner="run-1", ttl_s=30) as lease,
        ):
            answer = await lease.post(
                f"/tool/moved?to={target}",
                json={"text": "pay 100"},
                headers={"Idempotency-Key": "k-1"},
            )
        sent_again = fake.of("POST", "/tool/send")
        assert [c.headers.get("X-Fence-Token") for c in sent_again] == [], (
            "the fenced side effect was sent a second time, by the client itself"
        )
        assert answer.status == 307  # as SyncGatewayClient answers: it never follows one


# -- a refused upgrade on a session the caller passed -------------------------------------------


class TestSharedSessionUpgradeRefusal:
    """The problem document of a refused upgrade is read on a session the caller passed
    (`GatewayClient(url, session=...)`) as on one the client made: a `409 stale_fence` is
    LeaseLost, and the lease is lost (it was a plain `GatewayError("http_409")`)."""

    async def test_stale_fence_on_upgrade_is_lease_lost_with_a_shared_session(
        self, aiohttp_server: Any
    ) -> None:
        fake = FakeGateway()
        app = fake.app()

        async def refuse(_request: web.Request) -> web.StreamResponse:
            return _problem(409, "stale_fence", resource=RESOURCE)

        app.router.add_get("/ws/{tail:.*}", refuse)
        server = await aiohttp_server(app)
        url = str(server.make_url("")).rstrip("/")
        async with aiohttp.ClientSession() as session:
            gw = GatewayClient(url, session=session)
            async with gw.lease(RESOURCE, owner="run-1", ttl_s=30) as lease:
                with pytest.raises(LeaseLost) as caught:
                    await lease.websocket("/ws/devtools/browser")
                assert caught.value.code == "stale_fence"
                assert lease.lost


# -- a checkpoint's retry after the lease is lost --------------------------------------------


class TestCheckpointRetry:
    """A checkpoint whose answer was lost is retried only while the lease may still act: once
    the local deadline has passed, LeaseLost, and nothing more is sent (docs/contract.md §13,
    §17)."""

    @staticmethod
    async def _gateway(aiohttp_server: Any) -> FakeGateway:
        fake = FakeGateway()
        app = fake.app()
        state = {"calls": 0}

        async def checkpoint(request: web.Request) -> web.StreamResponse:
            state["calls"] += 1
            if state["calls"] == 1:  # written, but the answer is lost after a while
                await asyncio.sleep(0.5)
                assert request.transport is not None
                request.transport.close()
                await asyncio.sleep(1)
            body = await request.json()
            return web.json_response(
                {
                    "resource": request.match_info["resource"],
                    "seq": 1,
                    "fence": int(request.headers["X-Fence-Token"]),
                    "owner": request.headers.get("X-Lease-Owner"),
                    "client": None,
                    "step": body["step"],
                    "state": body["state"],
                    "at": "2026-01-01T00:00:00.000Z",
                }
            )

        app.router.add_put("/_gateway/v1/checkpoints/{resource:.+}", checkpoint)
        server = await aiohttp_server(app)
        fake.url = str(server.make_url("")).rstrip("/")  # type: ignore[attr-defined]
        return fake

    async def test_aio_checkpoint_is_not_resent_once_the_lease_is_lost(
        self, aiohttp_server: Any
    ) -> None:
        fake = await self._gateway(aiohttp_server)
        path = f"/_gateway/v1/checkpoints/{RESOURCE}"
        async with GatewayClient(fake.url) as gw:  # type: ignore[attr-defined]
            lease = gw.lease(RESOURCE, owner="run-1", ttl_s=0.4, auto_renew=False)
            await lease.acquire()
            with pytest.raises(LeaseLost):
                await lease.checkpoint("typed", {"n": 1})
            resent = [s.at for s in fake.of("PUT", path)[1:]]
            assert resent == [], "a checkpoint was sent after the lease's local deadline"

    async def test_sync_checkpoint_is_not_resent_once_the_lease_is_lost(
        self, aiohttp_server: Any
    ) -> None:
        fake = await self._gateway(aiohttp_server)
        path = f"/_gateway/v1/checkpoints/{RESOURCE}"

        def run() -> None:
            with SyncGatewayClient(fake.url) as gw:  # type: ignore[attr-defined]
                lease = gw.lease(RESOURCE, owner="run-1", ttl_s=0.4, auto_renew=False)
                lease.acquire()
                with pytest.raises(LeaseLost):
                    lease.checkpoint("typed", {"n": 1})

        await asyncio.to_thread(run)
        assert fake.of("PUT", path)[1:] == [], "a checkpoint was sent after the local deadline"


# -- a renewal answered 408 or 429 -----------------------------------------------------------


class TestTransientRefusals:
    """408 (the request came too slowly: the gateway's body timeout) and 429 (too many
    requests: a proxy on the way) say nothing about the lease: a renewal so answered is
    tried again, as after a 503, and the lease is lost only at its deadline. (They were
    taken for the gateway saying the lease is gone: lost at once, and no release sent.)"""

    @pytest.mark.parametrize("status", [408, 429])
    async def test_aio_a_renewal_answered_so_is_tried_again(
        self, fake: FakeGateway, status: int
    ) -> None:
        async with GatewayClient(fake.url) as gw:
            async with gw.lease(RESOURCE, owner="run-1", ttl_s=0.9) as lease:
                fake.renew_status = status
                await asyncio.sleep(0.45)  # a renewal or two answered `status`
                assert fake.of("PUT", LEASE_PATH)
                assert not lease.lost, lease.lost_reason
                fake.renew_status = None
                await asyncio.sleep(0.6)  # past the first deadline: renewed meanwhile
                assert not lease.lost, lease.lost_reason
            assert len(fake.of("DELETE", LEASE_PATH)) == 1

    @pytest.mark.parametrize("status", [408, 429])
    async def test_sync_a_renewal_answered_so_is_tried_again(
        self, fake: FakeGateway, status: int
    ) -> None:
        def run() -> tuple[bool, str | None]:
            with SyncGatewayClient(fake.url) as gw, gw.lease(RESOURCE, "run-1", 0.9) as lease:
                fake.renew_status = status
                time.sleep(0.45)
                assert fake.of("PUT", LEASE_PATH)
                first = lease.lost
                fake.renew_status = None
                time.sleep(0.6)
                return first or lease.lost, lease.lost_reason

        lost, reason = await asyncio.to_thread(run)
        assert not lost, reason
        assert len(fake.of("DELETE", LEASE_PATH)) == 1


async def test_a_lease_whose_client_is_closed_is_lost_and_its_renewal_ends(
    fake: FakeGateway,
) -> None:
    """Closing the client under a held lease: the next renewal finds the session closed, its
    task ends cleanly, and the lease says it is lost (never held until its deadline with no
    renewal behind it)."""
    gw = GatewayClient(fake.url)
    lease = gw.lease(RESOURCE, owner="run-1", ttl_s=3)
    await lease.acquire()
    renewer = lease._renewer
    await gw.close()
    assert renewer is not None
    await asyncio.wait_for(asyncio.shield(renewer), 5)  # ends, and raises nothing
    assert lease.lost and lease.lost_reason == "the client was closed"
    with pytest.raises(LeaseLost):
        await lease.post("/tool/send")
