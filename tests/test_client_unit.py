"""gateway.client against a small real gateway: lease endpoints of docs/contract.md §6 and one
proxied tool.

The fake answers like the gateway does (201/200/409 lease_held with Retry-After, 409
lease_lost, problem+json stale_fence) and records every request it receives, so "nothing was
sent" is checked where it matters: on the server, and in the client session's own trace.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.client import (
    RENEW_FRACTION,
    RENEW_JITTER,
    GatewayClient,
    GatewayError,
    LeaseHeld,
    LeaseLost,
    fenced_headers,
    renew_delay,
)

RESOURCE = "chat/room-1"
LEASE_PATH = f"/_gateway/v1/leases/{RESOURCE}"


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def _problem(
    status: int, code: str, headers: dict[str, str] | None = None, **extra: Any
) -> web.Response:
    body = {
        "type": f"urn:fence-gateway:{code}",
        "title": code,
        "status": status,
        "code": code,
        "detail": f"fake {code}",
        **extra,
    }
    return web.json_response(
        body, status=status, headers=headers, content_type="application/problem+json"
    )


@dataclass
class Seen:
    """One request as the fake received it."""

    method: str
    path: str
    headers: dict[str, str]
    query: dict[str, str]
    body: Any
    at: float


@dataclass
class FakeLease:
    owner: str
    fence: int
    expires: float  # time.monotonic()
    key: str | None
    acquired_at: datetime
    renewed_at: datetime | None = None


@dataclass
class FakeGateway:
    """Lease API and a proxied tool at /tool/..., with knobs to misbehave."""

    seen: list[Seen] = field(default_factory=list)
    leases: dict[str, FakeLease] = field(default_factory=dict)
    fences: dict[str, int] = field(default_factory=dict)
    renew_status: int | None = None  # force this status on every renewal
    acquire_delay_s: float = 0.0
    drop_first_acquire: bool = False  # commit the lease, then lose the answer

    def of(self, method: str, path: str | None = None) -> list[Seen]:
        return [s for s in self.seen if s.method == method and (path is None or s.path == path)]

    def hold(self, resource: str, owner: str, ttl_s: float) -> None:
        fence = self.fences[resource] = self.fences.get(resource, 0) + 1
        self.leases[resource] = FakeLease(
            owner, fence, time.monotonic() + ttl_s, None, datetime.now(UTC)
        )

    def app(self) -> web.Application:
        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            raw = await request.read()
            body = await request.json() if raw else None
            self.seen.append(
                Seen(
                    request.method,
                    request.path,
                    dict(request.headers),
                    dict(request.query),
                    body,
                    time.monotonic(),
                )
            )
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.router.add_route("*", "/_gateway/v1/leases/{resource:.+}", self.leases_api)
        app.router.add_route("*", "/tool/{tail:.*}", self.tool)
        return app

    def _doc(self, resource: str, lease: FakeLease) -> dict[str, Any]:
        ttl = lease.expires - time.monotonic()
        start = lease.renewed_at or lease.acquired_at
        expires_at = datetime.now(UTC) + timedelta(seconds=ttl)
        state = "held" if ttl > 0 else "expired"
        return {
            "resource": resource,
            "owner": lease.owner,
            "fence": lease.fence,
            "state": state,
            "acquired_at": _iso(lease.acquired_at),
            "renewed_at": _iso(start) if lease.renewed_at else None,
            "expires_at": _iso(max(expires_at, start)),
        }

    async def leases_api(self, request: web.Request) -> web.StreamResponse:
        resource = request.match_info["resource"]
        lease, now = self.leases.get(resource), time.monotonic()
        if not resource.startswith("chat/"):
            return _problem(403, "resource_not_allowed")
        if request.method == "POST":
            body, key = await request.json(), request.headers.get("Idempotency-Key")
            await asyncio.sleep(self.acquire_delay_s)
            if lease is not None and key is not None and lease.key == key:
                return web.json_response(self._doc(resource, lease), status=200)
            if lease is not None and lease.expires > now:
                wait = str(max(1, math.ceil(lease.expires - now)))
                return _problem(409, "lease_held", {"Retry-After": wait}, holder=lease.owner)
            self.hold(resource, body["owner"], body.get("ttl_s", 30))
            self.leases[resource].key = key
            if self.drop_first_acquire:
                self.drop_first_acquire = False
                request.transport.close()
                await asyncio.sleep(1)
            return web.json_response(self._doc(resource, self.leases[resource]), status=201)
        if request.method == "PUT":
            body = await request.json()
            if self.renew_status is not None:
                return _problem(
                    self.renew_status,
                    "lease_lost" if self.renew_status == 409 else "store_unavailable",
                )
            if (
                lease is None
                or lease.expires <= now
                or lease.fence != body["fence"]
                or lease.owner != body["owner"]
            ):
                return _problem(409, "lease_lost")
            lease.expires, lease.renewed_at = now + body.get("ttl_s", 30), datetime.now(UTC)
            return web.json_response(self._doc(resource, lease))
        if request.method == "DELETE":
            if lease is not None and str(lease.fence) == request.query.get("fence"):
                lease.expires = now
            return web.Response(status=204)
        return _problem(405, "method_not_allowed")

    async def tool(self, request: web.Request) -> web.StreamResponse:
        resource = request.headers.get("X-Lease-Resource", "")
        lease = self.leases.get(resource)
        if lease is None or str(lease.fence) != request.headers.get("X-Fence-Token"):
            return _problem(409, "stale_fence", resource=resource)
        if request.path.endswith("/missing"):
            return web.Response(status=404, text="no such thing")
        if request.path.endswith("/moved"):  # a tool that redirects where `?to=` says
            return web.Response(status=307, headers={"Location": request.query["to"]})
        return web.json_response({"ok": True}, headers={"X-Receipt-Id": "r-1"})


async def start_fake(aiohttp_server: Any) -> FakeGateway:
    """The fake gateway, served on 127.0.0.1 (`.url`) for one test."""
    gw = FakeGateway()
    server = await aiohttp_server(gw.app())
    gw.url = str(server.make_url(""))  # type: ignore[attr-defined]
    return gw


@pytest.fixture
async def fake(aiohttp_server: Any) -> Any:
    return await start_fake(aiohttp_server)


@pytest.fixture
async def traced() -> Any:
    """A session that counts every request it starts, to prove none started."""
    started: list[str] = []

    async def on_start(_s: Any, _c: Any, params: aiohttp.TraceRequestStartParams) -> None:
        started.append(f"{params.method} {params.url.path}")

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)
    async with aiohttp.ClientSession(trace_configs=[trace]) as session:
        yield session, started


@pytest.fixture
async def client(fake: FakeGateway, traced: Any) -> Any:
    session, _ = traced
    async with GatewayClient(fake.url, key="sekret", session=session) as gw:
        yield gw


class TestRenewDelay:
    """The renewal interval is a third of the TTL, spread by jitter so workers do not align."""

    def test_stays_within_the_jitter_band_and_spreads_across_it(self) -> None:
        rng = random.Random(7)
        delays = [renew_delay(30.0, rng) for _ in range(2000)]
        third = 30 * RENEW_FRACTION
        low, high = third * (1 - RENEW_JITTER), third * (1 + RENEW_JITTER)
        assert low <= min(delays) and max(delays) <= high
        assert min(delays) < low + 0.1 and max(delays) > high - 0.1
        assert len({round(d, 6) for d in delays}) > 1900

    def test_is_reproducible_with_a_seeded_rng(self) -> None:
        first = [renew_delay(9.0, random.Random(1)) for _ in range(3)]
        assert first == [renew_delay(9.0, random.Random(1)) for _ in range(3)]


class TestRenewal:
    """A held lease renews itself in the background and stays usable past its first TTL."""

    async def test_renews_at_about_a_third_of_the_ttl(
        self, client: GatewayClient, fake: FakeGateway
    ) -> None:
        async with client.lease(RESOURCE, owner="run-1", ttl_s=0.6) as lease:
            await asyncio.sleep(0.9)
            assert not lease.lost and lease.fence == 1
            assert (await lease.post("/tool/send")).status == 200
        acquired, renewals = fake.of("POST", LEASE_PATH)[0], fake.of("PUT", LEASE_PATH)
        assert [r.body for r in renewals] == [{"owner": "run-1", "fence": 1, "ttl_s": 0.6}] * len(
            renewals
        )
        assert 3 <= len(renewals) <= 5
        gaps = [b.at - a.at for a, b in zip([acquired, *renewals], renewals, strict=False)]
        assert all(
            0.2 * (1 - RENEW_JITTER) - 0.02 <= g <= 0.2 * (1 + RENEW_JITTER) + 0.05 for g in gaps
        ), gaps

    async def test_workers_acquired_together_renew_at_different_moments(
        self, client: GatewayClient, fake: FakeGateway
    ) -> None:
        leases = [client.lease(f"chat/room-{i}", owner="w", ttl_s=0.9) for i in range(20)]
        await asyncio.gather(*(lease.acquire() for lease in leases))
        await asyncio.sleep(0.4)
        firsts = sorted(s.at for s in fake.of("PUT"))
        await asyncio.gather(*(lease.release() for lease in leases))
        assert len(firsts) == 20
        assert firsts[-1] - firsts[0] > 0.02  # a band of ±0.045 s, not one instant

    async def test_local_deadline_counts_from_when_the_acquire_was_sent(
        self, client: GatewayClient, fake: FakeGateway
    ) -> None:
        fake.acquire_delay_s = 0.25
        lease = client.lease(RESOURCE, owner="run-1", ttl_s=1.0, auto_renew=False)
        await lease.acquire()
        assert 0.6 < lease.remaining_s <= 0.75
        await lease.release()


class TestLeaseLost:
    """Once lost, a fenced call raises LeaseLost and no request leaves the process."""

    async def test_renewal_refused_marks_the_lease_lost(
        self, client: GatewayClient, fake: FakeGateway, traced: Any
    ) -> None:
        _, started = traced
        async with client.lease(RESOURCE, owner="run-1", ttl_s=0.6) as lease:
            fake.renew_status = 409
            await asyncio.sleep(0.3)
            assert lease.lost and lease.lost_reason == "renewal refused: lease_lost"
            before, sent = len(fake.seen), list(started)
            with pytest.raises(LeaseLost) as caught:
                await lease.post("/tool/send", json={"text": "hi"})
            assert (caught.value.status, caught.value.code) == (None, "lease_lost")
            assert len(fake.seen) == before and started == sent
        assert fake.of("DELETE") == []  # the gateway already said it is gone
        assert fake.of("POST", "/tool/send") == []

    async def test_deadline_passing_while_renewals_fail_marks_it_lost(
        self, client: GatewayClient, fake: FakeGateway, traced: Any
    ) -> None:
        _, started = traced
        async with client.lease(RESOURCE, owner="run-1", ttl_s=0.5) as lease:
            fake.renew_status = 503
            await asyncio.sleep(0.3)
            assert not lease.lost  # a transient failure is not a loss, the deadline is
            await asyncio.sleep(0.3)
            assert lease.lost_reason == "expired: no successful renewal within the TTL"
            sent = list(started)
            with pytest.raises(LeaseLost):
                await lease.put("/tool/send")
            assert started == sent
        # Retried sooner as the deadline neared (a third of the TTL each time would make 2 or 3).
        assert len(fake.of("PUT", LEASE_PATH)) >= 4
        assert fake.of("PUT", "/tool/send") == []

    async def test_without_renewal_the_lease_is_lost_at_its_ttl(
        self, client: GatewayClient, fake: FakeGateway
    ) -> None:
        async with client.lease(RESOURCE, owner="run-1", ttl_s=0.3, auto_renew=False) as lease:
            assert (await lease.post("/tool/send")).status == 200
            await asyncio.sleep(0.35)
            with pytest.raises(LeaseLost):
                lease.check()
            with pytest.raises(LeaseLost):
                await lease.post("/tool/send")
        assert len(fake.of("POST", "/tool/send")) == 1
        assert fake.of("PUT") == []

    async def test_a_stale_fence_answer_marks_the_lease_lost(
        self, client: GatewayClient, fake: FakeGateway
    ) -> None:
        async with client.lease(RESOURCE, owner="run-1", ttl_s=30) as lease:
            fake.hold(RESOURCE, "run-2", 30)  # taken over behind the client's back
            with pytest.raises(LeaseLost) as caught:
                await lease.post("/tool/send")
            assert (caught.value.status, caught.value.code) == (409, "stale_fence")
            assert lease.lost_reason == "gateway refused a fenced call: stale_fence"
            with pytest.raises(LeaseLost):
                await lease.post("/tool/send")
        assert len(fake.of("POST", "/tool/send")) == 1
        assert fake.of("DELETE") == []  # its release would only be refused

    async def test_after_release_the_lease_cannot_act(
        self, client: GatewayClient, fake: FakeGateway
    ) -> None:
        async with client.lease(RESOURCE, owner="run-1", ttl_s=30) as lease:
            pass
        [release] = fake.of("DELETE", LEASE_PATH)
        assert release.query == {"owner": "run-1", "fence": "1"}
        assert lease.lost_reason == "released"
        with pytest.raises(LeaseLost):
            await lease.post("/tool/send")


class TestFencedCalls:
    """Fenced calls carry the lease headers; upstream answers come back as values."""

    async def test_headers_of_api_and_proxied_calls(
        self, client: GatewayClient, fake: FakeGateway
    ) -> None:
        async with client.lease(RESOURCE, owner="run-1", ttl_s=30) as lease:
            resp = await lease.post("/tool/send", json={"text": "hi"})
        assert (resp.status, resp.json(), resp.receipt_id) == (200, {"ok": True}, "r-1")
        [acquire] = fake.of("POST", LEASE_PATH)
        assert acquire.headers["Authorization"] == "Bearer sekret"
        assert "Proxy-Authorization" not in acquire.headers
        assert acquire.body == {"owner": "run-1", "ttl_s": 30}
        [call] = fake.of("POST", "/tool/send")
        wanted = {
            "X-Lease-Resource": RESOURCE,
            "X-Fence-Token": "1",
            "X-Lease-Owner": "run-1",
            "Proxy-Authorization": "Bearer sekret",
        }
        assert {k: call.headers.get(k) for k in wanted} == wanted
        assert "Authorization" not in call.headers and call.body == {"text": "hi"}

    async def test_an_upstream_error_is_returned_not_raised(self, client: GatewayClient) -> None:
        async with client.lease(RESOURCE, owner="run-1", ttl_s=30) as lease:
            resp = await lease.delete("/tool/missing")
            assert (resp.status, resp.text(), lease.lost) == (404, "no such thing", False)

    def test_fenced_headers_for_external_fences(self) -> None:
        assert fenced_headers("deploy/prod", 184, owner="run-8f21") == {
            "X-Lease-Resource": "deploy/prod",
            "X-Fence-Token": "184",
            "X-Lease-Owner": "run-8f21",
        }
        assert fenced_headers("deploy/prod", 2**63 - 1) == {
            "X-Lease-Resource": "deploy/prod",
            "X-Fence-Token": str(2**63 - 1),
        }
        for bad in (0, -1, 2**63, True, "7"):
            with pytest.raises(ValueError):
                fenced_headers("deploy/prod", bad)  # type: ignore[arg-type]


class TestAcquire:
    """Acquire retries politely on lease_held and safely when an answer is lost."""

    async def test_waits_for_retry_after_then_takes_over(
        self, client: GatewayClient, fake: FakeGateway
    ) -> None:
        fake.hold(RESOURCE, "run-old", 0.4)
        started = time.monotonic()
        async with client.lease(RESOURCE, owner="run-1", ttl_s=5, acquire_timeout_s=5) as lease:
            elapsed = time.monotonic() - started
            assert (lease.fence, lease.owner) == (2, "run-1")
        # Retry-After: 1 plus up to 25 % jitter; the bound above only says "one wait, not
        # two" (the exact pair of POSTs below says the rest), so a busy machine cannot fail it.
        assert 1.0 <= elapsed < 2.0
        first, second = fake.of("POST", LEASE_PATH)
        assert first.headers["Idempotency-Key"] != second.headers["Idempotency-Key"]

    async def test_gives_up_with_lease_held(self, client: GatewayClient, fake: FakeGateway) -> None:
        fake.hold(RESOURCE, "run-old", 30)
        started = time.monotonic()
        with pytest.raises(LeaseHeld) as caught:
            await client.lease(RESOURCE, owner="run-1", acquire_timeout_s=0.3).acquire()
        assert 0.3 <= time.monotonic() - started < 0.6
        held = caught.value
        assert (held.status, held.code, held.holder, held.retry_after) == (
            409,
            "lease_held",
            "run-old",
            30.0,
        )
        assert len(fake.of("POST", LEASE_PATH)) == 2  # the first try and one at the deadline

    async def test_a_lost_answer_is_retried_with_the_same_key(
        self, client: GatewayClient, fake: FakeGateway
    ) -> None:
        fake.drop_first_acquire = True
        async with client.lease(RESOURCE, owner="run-1", ttl_s=30) as lease:
            assert lease.fence == 1
        first, second = fake.of("POST", LEASE_PATH)
        assert first.headers["Idempotency-Key"] == second.headers["Idempotency-Key"]
        assert fake.fences[RESOURCE] == 1

    async def test_a_refusal_is_not_retried(self, client: GatewayClient, fake: FakeGateway) -> None:
        with pytest.raises(GatewayError) as caught:
            await client.lease("mail/inbox-1", owner="run-1").acquire()
        refusal = caught.value
        assert (type(refusal), refusal.status, refusal.code) == (
            GatewayError,
            403,
            "resource_not_allowed",
        )
        assert len(fake.of("POST")) == 1


class DropsReusedConnections:
    """A raw HTTP/1.1 server: on each connection it answers the first request (with a lease
    record, so an acquire works) and reads the second whole, then closes without answering.

    That is a keep-alive connection dying under a reused request, after the request arrived:
    a client that resends it makes the tool act twice.
    """

    def __init__(self) -> None:
        self.received: list[str] = []  # "METHOD target", in arrival order

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for turn in (1, 2):
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, target, _ = head[0].split(" ", 2)
                length = next(
                    (
                        int(line.split(":", 1)[1])
                        for line in head[1:]
                        if line.lower().startswith("content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                self.received.append(f"{method} {target}")
                if turn == 2:
                    return
                now = _iso(datetime.now(UTC))
                body = json.dumps(
                    {
                        "resource": RESOURCE,
                        "owner": "run-1",
                        "fence": 1,
                        "state": "held",
                        "acquired_at": now,
                        "renewed_at": None,
                        "expires_at": _iso(datetime.now(UTC) + timedelta(seconds=30)),
                    }
                ).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


class TestSentAtMostOnce:
    """aiohttp resends a PUT or DELETE once when a reused connection turns out dead."""

    async def test_a_fenced_put_on_a_dead_keep_alive_connection_is_sent_once(self) -> None:
        tool = DropsReusedConnections()
        server = await asyncio.start_server(tool.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with (
            server,
            GatewayClient(f"http://127.0.0.1:{port}", key="k") as gw,
            gw.lease(RESOURCE, owner="run-1", ttl_s=30, auto_renew=False) as lease,
        ):
            try:  # goes out on the acquire's keep-alive connection, which then dies
                await lease.put("/tool/send", json={"text": "hi"})
                answered = True
            except aiohttp.ServerDisconnectedError:
                answered = False
        assert tool.received == [
            f"POST {LEASE_PATH}",
            "PUT /tool/send",
            f"DELETE {LEASE_PATH}?owner=run-1&fence=1",
        ]
        assert not answered  # the caller learns the outcome is unknown; retrying is its call
