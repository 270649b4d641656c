"""The client library's sessions (docs/contract.md §13, §15): `lease.websocket(path)` opens a
fenced session with the lease's headers; a lease that is lost raises `LeaseLost` before
anything is sent; a refused upgrade raises the gateway's own code (`LeaseLost` for
`stale_fence`), read from the problem document aiohttp would otherwise drop; the gateway's
close says why; and `lease.cdp_headers()` is what Playwright and Puppeteer send.
"""

from __future__ import annotations

import pytest
from aiohttp import WSMsgType

from gateway.client import GatewayClient, GatewayError, LeaseLost, fenced_headers
from tests.harness import GatewayFactory
from tests.sessions.conftest import ws_policy
from tests.sessions.ws_upstream import Refusal, WsUpstream


async def test_lease_websocket_and_cdp_headers(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream
) -> None:
    gw = await gateway_factory(ws_policy(ws_upstream.url))
    async with GatewayClient(gw.url) as client:
        async with client.lease("gw/c", owner="run-1", ttl_s=30) as lease:
            assert lease.cdp_headers() == {
                "X-Lease-Resource": "gw/c",
                "X-Fence-Token": str(lease.fence),
                "X-Lease-Owner": "run-1",
            }
            async with await lease.websocket("/tool/ws") as ws:
                await ws.send_str("hi")
                assert (await ws.receive(timeout=5)).data == "hi"
            (conn,) = ws_upstream.connections
            assert conn.headers["X-Fence-Token"] == str(lease.fence)
            fence = lease.fence
            ws = await lease.websocket("/tool/ws")
        # released: the open session is closed by the gateway, and nothing more is sent
        closed = await ws.receive(timeout=5)
        assert (closed.type, closed.data, closed.extra) == (WSMsgType.CLOSE, 4408, "lease_expired")
        await ws.close()
        with pytest.raises(LeaseLost):
            await lease.websocket("/tool/ws")
        with pytest.raises(LeaseLost):
            lease.cdp_headers()
        assert len(ws_upstream.connections) == 2

        # a stale fence is refused by the gateway, with its code
        async with client.lease("gw/c", owner="run-2", ttl_s=30) as newer:
            assert newer.fence > fence
            with pytest.raises(LeaseLost) as stale:
                await client.websocket("/tool/ws", headers=fenced_headers("gw/c", fence))
            assert (stale.value.status, stale.value.code) == (409, "stale_fence")
            # the tool's own refusal is not the gateway's
            ws_upstream.refuse = Refusal(status=404)
            with pytest.raises(GatewayError) as refused:
                await newer.websocket("/tool/ws")
            assert (refused.value.status, refused.value.code) == (404, "http_404")
            assert not isinstance(refused.value, LeaseLost)
