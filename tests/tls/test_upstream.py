"""An upstream over HTTPS (docs/contract.md §22): `tls: {ca_file, cert_file, key_file,
server_name}` verifies the tool's certificate against a private CA, presents a client
certificate, and checks the certificate for `server_name` (sent as SNI too), whatever address
the tool is reached at. Verification cannot be turned off: a certificate that does not verify
is `502 upstream_unreachable`, `not_sent`. Calls and sessions' upgrades alike. The tool is a
real HTTPS server that requires a client certificate; the gateway a real subprocess."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.harness import (
    GatewayFactory,
    call,
    fenced_headers,
    make_policy,
    problem,
    wait_for,
)
from tests.sessions.ws_upstream import WsUpstream
from tests.tls.certs import Authority, server_context


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Any]:
    tool_ca = Authority(tmp_path / "tool-ca", "Tool CA")
    clients = Authority(tmp_path / "clients", "Gateway clients CA")
    return {
        "tool_ca": tool_ca,
        "clients": clients,
        # issued for a name only: reached at 127.0.0.1, it verifies only with server_name
        "tool": tool_ca.issue("tool", dns=("tool.internal",), ips=()),
        "gateway": clients.issue("gateway-client", client=True, ips=()),
    }


@pytest.fixture
async def https_tool(pki: dict[str, Any]) -> AsyncIterator[tuple[WsUpstream, list[str]]]:
    """The tool over HTTPS (it takes WebSocket upgrades too), client certificates of the
    clients' CA required; the SNI names its handshakes carried."""
    context = server_context(pki["tool"], client_ca=pki["clients"].cert)
    names: list[str] = []
    context.sni_callback = lambda _ssl, name, _ctx: names.append(name) and None
    async with WsUpstream(tls=context) as tool:
        yield tool, names


def upstream(name: str, url: str, **tls: Any) -> dict[str, Any]:
    return {"name": name, "url": url, "mount": f"/{name}", "connect_timeout_s": 2, "tls": tls}


async def test_a_private_ca_a_client_certificate_and_a_server_name(
    pki: dict[str, Any],
    https_tool: tuple[WsUpstream, list[str]],
    gateway_factory: GatewayFactory,
    session: aiohttp.ClientSession,
) -> None:
    tool, names = https_tool
    files = {
        "ca_file": str(pki["tool_ca"].cert),
        "cert_file": str(pki["gateway"].cert),
        "key_file": str(pki["gateway"].key),
    }
    other_ca = Authority(pki["tool_ca"].folder.parent / "other", "Other CA")
    document = make_policy(
        tool.url, [{"match": "ext/*"}], name="tool", tls={**files, "server_name": "tool.internal"}
    )
    document["upstreams"] += [
        {**upstream("sessions", tool.url, **files, server_name="tool.internal"), "websocket": True},
        upstream("unnamed", tool.url, **files),  # checked for 127.0.0.1: not in the cert
        upstream(
            "strange",
            tool.url,
            **{**files, "ca_file": str(other_ca.cert)},
            server_name="tool.internal",
        ),
    ]
    document["resources"] += [
        {"match": "ext/*", "upstream": name, "lease": {"issuer": "external"}}
        for name in ("unnamed", "strange", "sessions")
    ]
    gw = await gateway_factory(document)

    answered = await call(
        session, "POST", f"{gw.url}/tool/deploy", headers=fenced_headers("ext/1", 1)
    )
    assert answered.status == 200, answered.body
    (received,) = tool.received(path="/api/deploy")
    assert received.fence == 1
    # a session's upgrade goes the same way
    async with session.ws_connect(
        f"{gw.url.replace('http', 'ws', 1)}/sessions/ws", headers=fenced_headers("ext/3", 1)
    ) as ws:
        await ws.send_str("over tls")
        assert await ws.receive_str(timeout=5) == "over tls"
    assert [c.path_qs for c in tool.connections] == ["/api/ws"]
    assert set(names) == {"tool.internal"}  # the SNI of every handshake

    for mount, reason in (
        ("unnamed", "IP address mismatch"),
        ("strange", "unable to get local issuer certificate"),
    ):
        refused = await call(
            session, "POST", f"{gw.url}/{mount}/deploy", headers=fenced_headers("ext/2", 1)
        )
        body = problem(refused)
        assert (refused.status, body["code"]) == (502, "upstream_unreachable"), body
        assert "certificate verify failed" in body["detail"] and reason in body["detail"], body
        async with session.get(
            f"{gw.url}/_gateway/v1/receipts/{refused.headers['X-Receipt-Id']}"  # type: ignore[index]
        ) as resp:
            receipt = await resp.json()
        assert receipt["status"] == "not_sent", receipt
    assert len(tool.received(path="/api/deploy")) == 1

    # this gateway serves plain HTTP: SIGHUP has nothing to reload, and stops nothing
    gw.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    await wait_for(lambda: "tls_reload_skipped" in gw.stderr_text(), what="the skipped reload")
    assert gw.returncode is None
