"""The gateway in the HTTP clients agents already use (docs/contract.md §13, §16, §20), driven
for real against a gateway process: an MCP server that compresses its answers for a client
that accepts gzip (httpx always does) still has its tool calls recorded, and `lease.auth()`
sends the lease's current fence, also after the lease was acquired again."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from gateway.client import GatewayClient
from tests.harness import (
    GatewayFactory,
    GatewayProcess,
    RecordingUpstream,
    fetch_receipts,
    make_policy,
)
from tests.mcp.conftest import McpServerProcess, McpServerView, mcp_policy

MOUNT = "/mail"  # tests.mcp.conftest.mcp_policy's mount


class GzipMcpServer(McpServerProcess):
    """tests/mcp/mcp_server.py's server and tools, behind Starlette's stock GZipMiddleware,
    as an MCP server mounted in a FastAPI/Starlette app commonly is: it compresses
    `application/json` answers (not `text/event-stream`) for a client that accepts gzip."""

    SCRIPT = (
        "import sys, uvicorn\n"
        "from starlette.middleware.gzip import GZipMiddleware\n"
        "from tests.mcp import mcp_server\n"
        "app = mcp_server.Recorded(mcp_server.server.streamable_http_app())\n"
        "uvicorn.run(GZipMiddleware(app, minimum_size=64), host='127.0.0.1',\n"
        "            port=int(sys.argv[1]), log_level='warning')\n"
    )

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.SCRIPT, str(self.port), str(self.log)]


@pytest.fixture(scope="module")
def mcp_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpServerProcess]:
    with McpServerProcess(tmp_path_factory.mktemp("mcp-server")).serving() as server:
        yield server


@pytest.fixture(scope="module")
def gzip_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GzipMcpServer]:
    with GzipMcpServer(tmp_path_factory.mktemp("mcp-gzip")).serving() as server:
        yield server


@pytest.fixture
async def http_tool() -> AsyncIterator[RecordingUpstream]:
    async with RecordingUpstream(base_path="") as server:
        yield server


async def _receipts(gateway: GatewayProcess, resource: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        found = await fetch_receipts(session, gateway.url, resource=resource)
    return sorted(found, key=lambda r: r["created_at"])


# -- MCP: the gateway reads the answer a real client library made the server send --


async def test_a_tool_call_answered_by_a_compressing_mcp_server_is_recorded_and_replayed(
    gateway_factory: GatewayFactory, gzip_process: GzipMcpServer
) -> None:
    """httpx2 (the MCP SDK's client) and httpx send `Accept-Encoding: gzip, ...` on every
    request. The gateway reads a fenced tool call's JSON-RPC answer to decide its outcome
    (docs/contract.md §16), so it asks the MCP server for an uncompressed one: a server that
    compresses (Starlette's GZipMiddleware, as many MCP servers mounted in a web app have)
    has its call recorded `succeeded`, not outcome_unknown, and the agent's retry replayed."""
    server = McpServerView(gzip_process)
    gateway = await gateway_factory(mcp_policy(gzip_process.url))
    args = {"to": "bob-" + "x" * 200, "text": "the deploy is done"}  # an answer over 64 bytes
    async with (
        GatewayClient(gateway.url) as gw,
        gw.lease("mail/gzip", owner="run-1", ttl_s=30) as lease,
        httpx2.AsyncClient(auth=lease.auth(), timeout=20.0) as http,
        Client(streamable_http_client(f"{gateway.url}{MOUNT}/mcp", http_client=http)) as mcp,
    ):
        sent = await mcp.call_tool("send_email", args)
        assert not sent.is_error
        again = await mcp.call_tool("send_email", args)  # the agent's retry: a replay
        assert not again.is_error and again.structured_content == sent.structured_content
    assert len(server.effects("send_email")) == 1
    [receipt] = await _receipts(gateway, "mail/gzip")
    assert (receipt["status"], receipt["error"]) == ("succeeded", None)


# -- MCP: a refusal the framework can read --


# -- auth=: the fence it sends --


async def test_an_auth_taken_before_the_lease_was_acquired_again_sends_the_current_fence(
    gateway_factory: GatewayFactory, http_tool: RecordingUpstream
) -> None:
    """`lease.auth()` reads the lease's fence at each request, as its guard reads the lease.
    A lease acquired again (`Lease.acquire` after a loss or a release) has a new fence, and an
    httpx client built with `auth=lease.auth()` before sends that one, as `lease.post` does,
    not the old fence every call would be refused for (409 stale_fence)."""
    policy = make_policy(
        http_tool.url, [{"match": "deploy/*", "lease": {"issuer": "gateway", "ttl_s": 30}}]
    )
    gateway = await gateway_factory(policy)
    async with GatewayClient(gateway.url) as gw:
        lease = gw.lease("deploy/again", owner="run-1", ttl_s=30)
        await lease.acquire()
        auth = lease.auth()
        await lease.release()
        await lease.acquire()  # the same lease object, held again: fence 2
        try:
            assert lease.fence == 2 and not lease.lost
            async with httpx.AsyncClient(base_url=gateway.url, auth=auth) as http:
                answer = await http.post("/tool/releases", json={"version": "1.4.2"})
            assert answer.status_code == 200, answer.text
            [call] = http_tool.received(method="POST")
            assert call.fence == 2
        finally:
            await lease.release()
