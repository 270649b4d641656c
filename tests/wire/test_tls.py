"""`https://` upstreams: the certificate verified against the upstream's `tls.ca_file`, the
host name sent as SNI, the client certificate of `tls.cert_file` presented (a tool that
requires one), and a certificate that does not verify refused before anything is sent."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trustme
from multidict import CIMultiDict

from gateway.config.policy import Tls, Upstream
from gateway.proxy.upstream import UpstreamFailure, Upstreams


@dataclass
class TlsTool:
    port: int
    ca_file: Path
    cert_file: Path
    key_file: Path
    server_names: list[str | None] = field(default_factory=list)
    clients: list[str] = field(default_factory=list)  # the client certificates' common names


@pytest.fixture
async def tls_tool(tmp_path: Path) -> AsyncIterator[TlsTool]:
    """A tool on TLS with a certificate of a private CA for `localhost`, asking every
    client for a certificate of that CA."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    ca.configure_trust(server_context)
    server_context.verify_mode = ssl.CERT_REQUIRED
    client = ca.issue_cert("gateway@example.com", common_name="gateway")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    client.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "client.pem"))
    client.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    tool = TlsTool(0, tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client.key")

    def on_server_name(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        tool.server_names.append(name)

    server_context.sni_callback = on_server_name  # type: ignore[assignment]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            subject = dict(item[0] for item in writer.get_extra_info("peercert")["subject"])
            tool.clients.append(subject["commonName"])
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecret")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_context)
    tool.port = server.sockets[0].getsockname()[1]
    yield tool
    server.close()


async def call(tool: TlsTool, tls: Tls) -> tuple[int, bytes]:
    upstream = Upstream(
        name="tool", url=f"https://localhost:{tool.port}/api", mount="/tool", tls=tls
    )
    upstreams = Upstreams({"tool": upstream})
    await upstreams.open()
    try:
        deadline = asyncio.get_running_loop().time() + 5
        headers = CIMultiDict(Host=upstream.authority)
        async with await upstreams.send(upstream, "GET", "/x", headers, None, deadline) as answer:
            return answer.status, await answer.read()
    finally:
        await upstreams.close()


async def test_a_private_ca_and_a_client_certificate(tls_tool: TlsTool) -> None:
    tls = Tls(
        ca_file=str(tls_tool.ca_file),
        cert_file=str(tls_tool.cert_file),
        key_file=str(tls_tool.key_file),
    )
    assert await call(tls_tool, tls) == (200, b"secret")
    assert tls_tool.server_names == ["localhost"]
    assert tls_tool.clients == ["gateway"]


async def test_a_certificate_that_does_not_verify_is_not_sent(tls_tool: TlsTool) -> None:
    """Without the private CA, the tool's certificate is refused at the handshake: the call
    is `not_sent`, `502 upstream_unreachable`."""
    with pytest.raises(UpstreamFailure) as failure:
        await call(tls_tool, Tls())
    assert failure.value.outcome == "not_sent"
    assert failure.value.error.code == "upstream_unreachable"
    assert "CERTIFICATE_VERIFY_FAILED" in failure.value.error.detail
    assert tls_tool.clients == []
