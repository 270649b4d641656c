"""`SyncGatewayClient` against a real gateway process (docs/contract.md §20): a fenced call,
a checkpoint and the run view a successor reads; LeaseHeld while another worker holds the
resource; a lease revoked under a running worker is lost at its next renewal, and its next call
raises LeaseLost without reaching the tool. `lease.auth()` of a lease taken over: the gateway,
not the callable, refuses the stale fence. And HTTPS, with a client certificate (§22)."""

from __future__ import annotations

import asyncio
import ssl
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests

from gateway.client import LeaseHeld, LeaseLost, SyncGatewayClient
from tests.harness import GatewayFactory, GatewayProcess, RecordingUpstream, make_policy
from tests.tls.certs import Authority, client_context

RESOURCE = "task/run-1"
RULE = {"match": "task/*", "lease": {"issuer": "gateway", "ttl_s": 30, "max_ttl_s": 60}}


@pytest.fixture
async def gateway(gateway_factory: GatewayFactory, upstream: RecordingUpstream) -> GatewayProcess:
    return await gateway_factory(make_policy(upstream.url, [RULE]))


async def revoke(gateway: GatewayProcess, resource: str) -> None:
    url = f"{gateway.url}/_gateway/v1/leases/{resource}"
    async with aiohttp.ClientSession() as session, session.delete(url, params={"force": "true"}):
        pass


class TestSyncClientE2E:
    """What an agent with no event loop does, end to end."""

    async def test_a_call_a_checkpoint_and_the_successors_view(
        self, gateway: GatewayProcess, upstream: RecordingUpstream
    ) -> None:
        def worker_a() -> tuple[int, int]:
            with (
                SyncGatewayClient(gateway.url) as gw,
                gw.lease(RESOURCE, owner="run-a", ttl_s=30) as lease,
            ):
                answer = lease.post("/tool/send", json={"text": "hi"})
                lease.checkpoint("sent", {"message": 1})
                with pytest.raises(LeaseHeld):  # a second worker waits, then gives up
                    gw.lease(RESOURCE, owner="run-b", acquire_timeout_s=0.2).acquire()
                return answer.status, lease.fence

        def worker_b() -> Any:
            with (
                SyncGatewayClient(gateway.url) as gw,
                gw.lease(RESOURCE, owner="run-b", ttl_s=30) as lease,
            ):
                return gw.resume(RESOURCE), lease.fence

        assert await asyncio.to_thread(worker_a) == (200, 1)
        view, fence = await asyncio.to_thread(worker_b)
        assert fence == 2
        assert (view.checkpoint.step, view.checkpoint.state, view.checkpoint.fence) == (
            "sent",
            {"message": 1},
            1,
        )
        assert view.completed == [] and view.needs_confirmation == []  # the call came before
        [call] = upstream.received()
        assert (call.resource, call.fence, call.body) == (RESOURCE, 1, b'{"text": "hi"}')

    async def test_a_revoked_lease_is_lost_and_sends_nothing(
        self, gateway: GatewayProcess, upstream: RecordingUpstream
    ) -> None:
        def worker(loop: asyncio.AbstractEventLoop) -> str:
            with (
                SyncGatewayClient(gateway.url) as gw,
                gw.lease(RESOURCE, owner="run-a", ttl_s=1.5) as lease,
            ):
                asyncio.run_coroutine_threadsafe(revoke(gateway, RESOURCE), loop).result(10)
                deadline = time.monotonic() + 5
                while not lease.lost and time.monotonic() < deadline:
                    time.sleep(0.05)  # the renewal thread learns it within a third of the TTL
                with pytest.raises(LeaseLost):
                    lease.post("/tool/send", json={"text": "late"})
                with pytest.raises(LeaseLost):
                    requests.post(f"{gateway.url}/tool/send", auth=lease.auth(), timeout=5)
                return str(lease.lost_reason)

        loop = asyncio.get_running_loop()
        reason = await asyncio.to_thread(worker, loop)
        assert reason == "renewal refused: lease_lost"
        assert upstream.received() == []

    async def test_a_taken_over_lease_is_refused_by_the_gateway(
        self, gateway: GatewayProcess, upstream: RecordingUpstream
    ) -> None:
        def run() -> tuple[int, str]:
            with SyncGatewayClient(gateway.url) as gw:
                old = gw.lease(RESOURCE, owner="run-a", ttl_s=30, auto_renew=False)
                old.acquire()
                auth = old.auth()
                gw.release(RESOURCE, "run-a", old.fence)  # behind the old lease's back
                with gw.lease(RESOURCE, owner="run-b", ttl_s=30):
                    answer = requests.post(f"{gateway.url}/tool/send", auth=auth, timeout=5)
                    return answer.status_code, answer.json()["code"]

        assert await asyncio.to_thread(run) == (409, "stale_fence")
        assert upstream.received() == []

    async def test_over_https_with_a_client_certificate(
        self, tmp_path: Path, upstream: RecordingUpstream, gateway_factory: GatewayFactory
    ) -> None:
        ca = Authority(tmp_path / "pki")
        env = {
            "GATEWAY_TLS_CERT": str((pair := ca.issue("gateway")).cert),
            "GATEWAY_TLS_KEY": str(pair.key),
            "GATEWAY_TLS_CLIENT_CA": str(ca.cert),
        }
        agent = client_context(ca.cert, ca.issue("agent", client=True))
        gateway = await gateway_factory(make_policy(upstream.url, [RULE]), extra_env=env, tls=agent)

        def run() -> int:
            with (
                SyncGatewayClient(gateway.url, ssl_context=agent) as gw,
                gw.lease(RESOURCE, owner="run-a", ttl_s=30) as lease,
            ):
                return lease.post("/tool/send", json={"text": "hi"}).status

        def without_a_certificate() -> None:
            SyncGatewayClient(gateway.url, ssl_context=client_context(ca.cert)).acquire(
                RESOURCE, "run-b"
            )

        assert gateway.url.startswith("https://")
        assert await asyncio.to_thread(run) == 200
        with pytest.raises((ssl.SSLError, ConnectionError)):  # the handshake is refused
            await asyncio.to_thread(without_a_certificate)
        [call] = upstream.received()
        assert (call.fence, call.headers["X-Forwarded-Proto"]) == (1, "https")
