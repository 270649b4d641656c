"""Sessions of an HTTPS gateway (docs/contract.md §15, §22): CDP discovery answers point at
`wss://` addresses of the gateway, and a client that follows one opens its fenced session
over TLS, as Playwright's `connect_over_cdp` would. The browser is the fake WebSocket tool
of the session tests, answering discovery as Chromium does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.harness import GatewayFactory, fenced_headers, make_policy
from tests.sessions.test_discovery import TARGET, VERSION, chromium_like
from tests.sessions.ws_upstream import WsUpstream
from tests.tls.certs import Authority, client_context


@pytest.fixture
async def browser() -> AsyncIterator[WsUpstream]:
    async with WsUpstream() as server:
        chromium_like(server)
        yield server


async def test_discovery_answers_wss_and_the_session_runs_over_tls(
    tmp_path: Path, browser: WsUpstream, gateway_factory: GatewayFactory
) -> None:
    ca = Authority(tmp_path / "pki")
    pair, trusting = ca.issue("gateway"), client_context(ca.cert)
    gw = await gateway_factory(
        make_policy(browser.url, [{"match": "ext/*"}], mount="/cdp", cdp=True),
        extra_env={"GATEWAY_TLS_CERT": str(pair.cert), "GATEWAY_TLS_KEY": str(pair.key)},
        tls=trusting,
    )
    here = f"127.0.0.1:{gw.port}"
    connector = aiohttp.TCPConnector(ssl=trusting)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(f"{gw.url}/cdp/json/version") as resp:
            version = await resp.json()
        assert version == {
            **VERSION,
            "webSocketDebuggerUrl": f"wss://{here}/cdp/devtools/browser/b-1",
        }
        async with session.get(f"{gw.url}/cdp/json/list") as resp:
            (target,) = await resp.json()
        assert target == {
            **TARGET,
            "devtoolsFrontendUrl": f"/devtools/inspector.html?wss={here}/cdp/devtools/page/P1",
            "webSocketDebuggerUrl": f"wss://{here}/cdp/devtools/page/P1",
        }

        async with session.ws_connect(
            target["webSocketDebuggerUrl"], headers=fenced_headers("ext/1", 1)
        ) as ws:
            await ws.send_str('{"id": 1, "method": "Page.navigate"}')
            echoed = await ws.receive_str(timeout=5)
    assert echoed == '{"id": 1, "method": "Page.navigate"}'
    (connection,) = browser.connections
    assert (connection.path_qs, connection.fence) == ("/api/devtools/page/P1", 1)
