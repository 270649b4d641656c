"""`lease.auth()` and `fenced_auth()` as the `auth=` of httpx (sync and async), httpx2 (sync
and async) and requests, against the small real gateway of test_client_unit
(docs/contract.md §20): the lease headers arrive on every request, the client key only at the
gateway's origin, and once the lease is lost nothing is sent at all."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import httpx2
import pytest
import requests

from gateway.client import FencedAuth, GatewayClient, LeaseLost, fenced_auth
from tests.test_client_unit import RESOURCE, FakeGateway, start_fake

Send = Callable[[str, Any], Awaitable[int]]


async def _httpx_async(url: str, auth: Any) -> int:
    async with httpx.AsyncClient(auth=auth) as client:
        return (await client.post(url, json={"text": "hi"})).status_code


async def _httpx2_async(url: str, auth: Any) -> int:
    async with httpx2.AsyncClient(auth=auth) as client:
        return (await client.post(url, json={"text": "hi"})).status_code


def _httpx_sync(url: str, auth: Any) -> int:
    with httpx.Client(auth=auth) as client:
        return client.post(url, json={"text": "hi"}).status_code


def _httpx2_sync(url: str, auth: Any) -> int:
    with httpx2.Client(auth=auth) as client:
        return client.post(url, json={"text": "hi"}).status_code


def _requests(url: str, auth: Any) -> int:
    return requests.post(url, json={"text": "hi"}, auth=auth, timeout=10).status_code


def _requests_session(url: str, auth: Any) -> int:
    with requests.Session() as session:
        session.auth = auth
        return session.post(url, json={"text": "hi"}, timeout=10).status_code


def _in_thread(call: Callable[[str, Any], int]) -> Send:
    async def send(url: str, auth: Any) -> int:  # the fake gateway runs on this test's loop
        return await asyncio.to_thread(call, url, auth)

    return send


CLIENTS: dict[str, Send] = {
    "httpx-async": _httpx_async,
    "httpx-sync": _in_thread(_httpx_sync),
    "httpx2-async": _httpx2_async,
    "httpx2-sync": _in_thread(_httpx2_sync),
    "requests": _in_thread(_requests),
    "requests-session": _in_thread(_requests_session),
}


@pytest.fixture(params=sorted(CLIENTS))
def send(request: pytest.FixtureRequest) -> Send:
    return CLIENTS[request.param]


@pytest.fixture
async def fake(aiohttp_server: Any) -> FakeGateway:
    return await start_fake(aiohttp_server)


class TestLeaseAuth:
    """One callable fences every request of every client library, and stops them when lost."""

    async def test_the_lease_headers_and_the_key_arrive(
        self, fake: FakeGateway, send: Send
    ) -> None:
        async with (
            GatewayClient(fake.url, key="sekret") as gw,
            gw.lease(RESOURCE, owner="run-1", ttl_s=30) as lease,
        ):
            auth = lease.auth()
            assert await send(f"{fake.url}/tool/send", auth) == 200
            assert await send(f"{fake.url}/tool/send", auth) == 200  # every request, again
        calls = fake.of("POST", "/tool/send")
        wanted = {
            "X-Lease-Resource": RESOURCE,
            "X-Fence-Token": "1",
            "X-Lease-Owner": "run-1",
            "Proxy-Authorization": "Bearer sekret",
        }
        assert [{k: c.headers.get(k) for k in wanted} for c in calls] == [wanted, wanted]
        assert [c.body for c in calls] == [{"text": "hi"}] * 2
        assert "sekret" not in repr(auth)

    async def test_a_lost_lease_sends_nothing(self, fake: FakeGateway, send: Send) -> None:
        async with GatewayClient(fake.url) as gw:
            lease = gw.lease(RESOURCE, owner="run-1", ttl_s=0.3, auto_renew=False)
            await lease.acquire()
            auth = lease.auth()  # taken while valid, used after the deadline
            await asyncio.sleep(0.35)
            before = len(fake.seen)
            with pytest.raises(LeaseLost) as caught:
                await send(f"{fake.url}/tool/send", auth)
            assert caught.value.status is None and caught.value.code == "lease_lost"
            assert len(fake.seen) == before
            with pytest.raises(LeaseLost):
                lease.auth()
            await lease.release()
        assert fake.of("POST", "/tool/send") == []

    async def test_the_key_goes_to_the_gateway_only(self, fake: FakeGateway) -> None:
        elsewhere = fake.url.replace("127.0.0.1", "localhost")  # another origin, same server
        async with (
            GatewayClient(fake.url, key="sekret") as gw,
            gw.lease(RESOURCE, owner="run-1", ttl_s=30) as lease,
        ):
            assert await _httpx_async(f"{elsewhere}/tool/send", lease.auth()) == 200
        [call] = fake.of("POST", "/tool/send")
        assert call.headers["X-Fence-Token"] == "1"
        assert "Proxy-Authorization" not in call.headers


class TestRedirects:
    """What the README says of redirects: the callable sees the first request only, so a
    redirect that httpx or httpx2 follows to another origin keeps every header of it, the key
    included; requests keeps the fence headers and drops Proxy-Authorization."""

    @pytest.mark.parametrize("library", ["httpx", "httpx2", "requests"])
    async def test_headers_that_follow_a_redirect_to_another_origin(
        self, fake: FakeGateway, library: str
    ) -> None:
        elsewhere = fake.url.replace("127.0.0.1", "localhost") + "/tool/send"
        url = f"{fake.url}/tool/moved?to={elsewhere}"
        async with (
            GatewayClient(fake.url, key="sekret") as gw,
            gw.lease(RESOURCE, owner="run-1", ttl_s=30) as lease,
        ):
            auth = lease.auth()
            if library == "requests":
                status = await asyncio.to_thread(
                    lambda: requests.post(url, json={}, auth=auth, timeout=10).status_code
                )
            else:
                module: Any = httpx if library == "httpx" else httpx2
                async with module.AsyncClient(auth=auth, follow_redirects=True) as client:
                    status = (await client.post(url, json={})).status_code
        assert status == 200
        [followed] = fake.of("POST", "/tool/send")
        assert followed.headers["X-Fence-Token"] == "1"
        key = followed.headers.get("Proxy-Authorization")
        assert key == (None if library == "requests" else "Bearer sekret")


class TestFencedAuth:
    """`fenced_auth` does the same for a fence issued elsewhere."""

    async def test_its_headers_arrive(self, fake: FakeGateway, send: Send) -> None:
        fake.hold(RESOURCE, "run-9", 30)
        assert await send(f"{fake.url}/tool/send", fenced_auth(RESOURCE, 1, "run-9")) == 200
        [call] = fake.of("POST", "/tool/send")
        assert (call.headers["X-Fence-Token"], call.headers["X-Lease-Owner"]) == ("1", "run-9")
        assert "Proxy-Authorization" not in call.headers

    def test_a_bad_fence_is_refused_when_built(self) -> None:
        for bad in (0, 2**63, True, "7"):
            with pytest.raises(ValueError):
                fenced_auth(RESOURCE, bad)  # type: ignore[arg-type]
        assert isinstance(fenced_auth(RESOURCE, 7), FencedAuth)
