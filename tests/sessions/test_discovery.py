"""CDP discovery through the gateway (docs/contract.md §15): with `cdp: true`, the JSON answers
of `/json/version`, `/json/list`, `/json` (also with a trailing `/`) and the fenced
`PUT /json/new` point every WebSocket URL at the gateway: at `GATEWAY_PUBLIC_URL` when set,
else at the `Host` the client used, `wss` when a trusted proxy says `https`. Everything else
in them, and every other answer, passes as it came; a replayed `/json/new` is rewritten too.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp.test_utils import TestServer

from gateway.config.policy_files import load_policies
from gateway.config.settings import Settings
from gateway.server.app import create_app
from tests.harness import (
    AppFactory,
    Behavior,
    RecordingUpstream,
    fenced_headers,
    make_policy,
    write_policy,
)

VERSION = {
    "Browser": "HeadlessChrome/131.0",
    "Protocol-Version": "1.3",
    "User-Agent": "Mozilla/5.0",
    "webSocketDebuggerUrl": "ws://10.0.0.5:9222/devtools/browser/b-1",
}
TARGET = {
    "description": "",
    "devtoolsFrontendUrl": "/devtools/inspector.html?ws=10.0.0.5:9222/devtools/page/P1",
    "id": "P1",
    "title": "about:blank",
    "type": "page",
    "url": "about:blank",
    "webSocketDebuggerUrl": "ws://10.0.0.5:9222/devtools/page/P1",
}


def chromium_like(upstream: RecordingUpstream) -> None:
    def answer(document: Any) -> Behavior:
        return Behavior(body=json.dumps(document).encode())

    for path in ("/api/json/version", "/api/json/version/"):
        upstream.script(path, answer(VERSION))
    for path in ("/api/json", "/api/json/", "/api/json/list", "/api/json/list/"):
        upstream.script(path, answer([TARGET]))
    upstream.script("/api/json/new", answer(TARGET))
    upstream.script("/api/json/protocol", answer({"webSocketDebuggerUrl": "ws://x/untouched"}))


def policy(upstream: RecordingUpstream) -> dict[str, Any]:
    return make_policy(upstream.url, [{"match": "ext/*"}], mount="/cdp", cdp=True)


async def test_discovery_answers_point_at_the_gateway(
    make_app: AppFactory, upstream: RecordingUpstream
) -> None:
    chromium_like(upstream)
    gw = await make_app(policy(upstream))
    here = f"{gw.host}:{gw.port}"
    for path in ("/cdp/json/version", "/cdp/json/version/"):
        status, headers, body = await gw.send("GET", path)
        assert status == 200 and headers["Content-Length"] == str(len(json.dumps(body, indent=2)))
        assert body == {**VERSION, "webSocketDebuggerUrl": f"ws://{here}/cdp/devtools/browser/b-1"}
    for path in ("/cdp/json", "/cdp/json/", "/cdp/json/list", "/cdp/json/list/"):
        status, _, body = await gw.send("GET", path)
        assert body == [
            {
                **TARGET,
                "devtoolsFrontendUrl": f"/devtools/inspector.html?ws={here}/cdp/devtools/page/P1",
                "webSocketDebuggerUrl": f"ws://{here}/cdp/devtools/page/P1",
            }
        ]
    _, _, untouched = await gw.send("GET", "/cdp/json/protocol")
    assert untouched == {"webSocketDebuggerUrl": "ws://x/untouched"}

    # the fenced PUT /json/new, and its replay
    for replayed in (False, True):
        status, headers, body = await gw.send(
            "PUT", "/cdp/json/new?about:blank", headers=fenced_headers("ext/1", 1)
        )
        assert status == 200 and body["webSocketDebuggerUrl"] == f"ws://{here}/cdp/devtools/page/P1"
        assert (headers.get("Idempotent-Replayed") == "true") is replayed
    assert len(upstream.received(path="/api/json/new")) == 1


async def test_the_public_url_and_a_trusted_proxy_s_https(
    make_app: AppFactory, upstream: RecordingUpstream, tmp_path: Path
) -> None:
    chromium_like(upstream)
    public = await make_app(policy(upstream), public_url="https://gw.example.com/edge/")
    _, _, body = await public.send("GET", "/cdp/json/list")
    assert body[0]["webSocketDebuggerUrl"] == "wss://gw.example.com/edge/cdp/devtools/page/P1"
    assert body[0]["devtoolsFrontendUrl"] == (
        "/devtools/inspector.html?wss=gw.example.com/edge/cdp/devtools/page/P1"
    )

    behind = await make_app(
        policy(upstream), trusted_proxies="127.0.0.1", database_url=f"sqlite:///{tmp_path}/2.db"
    )
    https = {"X-Forwarded-Proto": "https", "Host": "shop.example.com"}
    _, _, body = await behind.send("GET", "/cdp/json/version", headers=https)
    assert body["webSocketDebuggerUrl"] == "wss://shop.example.com/cdp/devtools/browser/b-1"


async def test_an_untrusted_peer_s_https_is_not_believed(
    make_app: AppFactory, upstream: RecordingUpstream
) -> None:
    chromium_like(upstream)
    gw = await make_app(policy(upstream))
    _, _, body = await gw.send("GET", "/cdp/json/version", headers={"X-Forwarded-Proto": "https"})
    assert body["webSocketDebuggerUrl"].startswith("ws://")


class TestCdpIpv6Fallback:
    """Without a usable Host header (HTTP/1.0, or one the pattern refuses), the WebSocket URL
    is built from the socket's own address, an IPv6 one in brackets: `ws://::1:8080/...` is no
    URL a client can parse."""

    async def test_webSocketDebuggerUrl_on_an_ipv6_listener_without_host(
        self, tmp_path: Any
    ) -> None:
        async with RecordingUpstream() as upstream:
            chromium_like(upstream)
            path = write_policy(tmp_path / "policies.yaml", policy(upstream))
            app = create_app(
                Settings(
                    _env_file=None,
                    database_url=f"sqlite:///{tmp_path}/gw.db",
                    policies=str(path),
                    instance_id="test-1",
                    sweep_interval_s=0.1,
                ),
                load_policies(path, None),
                None,
            )
            server = TestServer(app, host="::1")
            await server.start_server()
            port = server.port
            try:
                reader, writer = await asyncio.open_connection("::1", port)
                writer.write(b"GET /cdp/json/version HTTP/1.0\r\n\r\n")  # HTTP/1.0: no Host
                await writer.drain()
                raw = await asyncio.wait_for(reader.read(), 10)
                writer.close()
            finally:
                await server.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0]
        url = json.loads(body)["webSocketDebuggerUrl"]
        parts = urlsplit(url)
        assert (parts.hostname, parts.port) == ("::1", port), url
