"""MCP tool calls through the gateway (docs/contract.md §16), with the official SDK as both
the server (a subprocess over Streamable HTTP) and the client, and the gateway a subprocess.

The client speaks the 2026-07-28 revision (`mode="auto"` finds it); `test_legacy_revision`
runs the 2025 handshake (sessions, GET stream, DELETE) through the same gateway.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from gateway.client import GatewayClient, mcp_meta
from gateway.core.mcp import FENCE_ERROR_CODE, LEASE_META_KEY
from tests.harness import GatewayProcess, fenced_headers, fetch_receipts
from tests.mcp.conftest import MOUNT, McpServerView


def mcp_client(
    gateway: GatewayProcess, headers: dict[str, str] | None = None, **kwargs: Any
) -> Client:
    """An SDK client of the MCP server through the gateway; `headers` go on every POST."""
    http = httpx2.AsyncClient(headers=headers or {}, timeout=httpx2.Timeout(20.0))
    return Client(streamable_http_client(f"{gateway.url}{MOUNT}/mcp", http_client=http), **kwargs)


async def acquire(
    session: aiohttp.ClientSession, gateway: GatewayProcess, resource: str, owner: str
) -> int:
    async with session.post(
        f"{gateway.url}/_gateway/v1/leases/{resource}", json={"owner": owner, "ttl_s": 30}
    ) as resp:
        assert resp.status == 201, await resp.text()
        return int((await resp.json())["fence"])


def refusal(exc: pytest.ExceptionInfo[MCPError]) -> dict[str, Any]:
    """The problem object a gateway refusal carries as its JSON-RPC error's data."""
    assert exc.value.code == FENCE_ERROR_CODE, exc.value.error
    data = exc.value.data
    assert isinstance(data, dict) and data["type"] == f"urn:fence-gateway:{data['code']}", data
    assert exc.value.message == data["title"]
    return data


async def test_unfenced_pass_a_fenced_call_goes_once_and_leaves_a_receipt(
    mcp_gateway: GatewayProcess, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    async with (
        GatewayClient(mcp_gateway.url) as gw,
        gw.lease("mail/alice", owner="run-1", ttl_s=30) as lease,
        mcp_client(mcp_gateway) as client,  # no lease headers at all
    ):
        tools = await client.list_tools()
        assert {t.name for t in tools.tools} >= {"send_email", "deploy", "lookup"}
        looked = await client.call_tool("lookup", {"q": "hi"})
        assert looked.structured_content == {"result": "HI"}
        sent = await client.call_tool(
            "send_email", {"to": "bob", "text": "hello"}, meta=lease.mcp_meta()
        )
        assert not sent.is_error and sent.structured_content == {"result": "sent to bob"}
        fence = lease.fence

    assert [e["to"] for e in mcp_server.effects("send_email")] == ["bob"]
    # the server never saw the lease in the body; it got the fence as headers of the call
    calls = [r for r in mcp_server.requests() if '"tools/call"' in r["body"]]
    assert len(calls) == 2 and all(LEASE_META_KEY not in r["body"] for r in calls)
    fenced = next(r for r in calls if "send_email" in r["body"])
    assert fenced["headers"]["x-fence-token"] == str(fence)
    assert fenced["headers"]["idempotency-key"].startswith("gw-")
    assert "x-fence-token" not in next(r for r in calls if "lookup" in r["body"])["headers"]
    # one receipt, for the fenced call only
    receipts = await fetch_receipts(session, mcp_gateway.url, resource="mail/alice")
    assert [(r["status"], r["owner"], r["method"], r["path"]) for r in receipts] == [
        ("succeeded", "run-1", "POST", "/mcp")
    ]
    assert receipts[0]["mcp"]["tool"] == "send_email"
    assert isinstance(receipts[0]["mcp"]["jsonrpc_id"], int)
    everything = await fetch_receipts(session, mcp_gateway.url)
    assert len(everything) == 1


async def test_a_missing_lease_is_a_jsonrpc_error_and_the_tool_never_runs(
    mcp_gateway: GatewayProcess, mcp_server: McpServerView
) -> None:
    async with mcp_client(mcp_gateway) as client:
        with pytest.raises(MCPError) as missing:
            await client.call_tool("send_email", {"to": "bob", "text": "hello"})
        assert refusal(missing)["code"] == "missing_resource"
        with pytest.raises(MCPError) as no_fence:
            await client.call_tool(
                "send_email",
                {"to": "bob", "text": "hi"},
                meta={LEASE_META_KEY: {"resource": "mail/x"}},
            )
        assert refusal(no_fence)["code"] == "missing_fence"
        with pytest.raises(MCPError) as text_fence:
            await client.call_tool(
                "send_email",
                {"to": "bob", "text": "hi"},
                meta={LEASE_META_KEY: {"resource": "mail/x", "fence": "1"}},
            )
        assert refusal(text_fence)["code"] == "invalid_fence"
    assert mcp_server.effects("send_email") == []


async def test_a_stale_owner_is_refused_before_the_tool(
    mcp_gateway: GatewayProcess, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    old = await acquire(session, mcp_gateway, "mail/bob", "run-a")
    async with session.delete(f"{mcp_gateway.url}/_gateway/v1/leases/mail/bob?force=true") as r:
        assert r.status == 204
    new = await acquire(session, mcp_gateway, "mail/bob", "run-b")
    assert new > old
    async with mcp_client(mcp_gateway, fenced_headers("mail/bob", new)) as client_b:
        await client_b.call_tool("send_email", {"to": "carol", "text": "from b"})
    # the old owner, its lease in the connection's headers, paused past its lease
    async with mcp_client(mcp_gateway, fenced_headers("mail/bob", old)) as client_a:
        with pytest.raises(MCPError) as stale:
            await client_a.call_tool("send_email", {"to": "carol", "text": "from a"})
    problem = refusal(stale)
    assert (problem["code"], problem["status"], problem["fence"]) == ("stale_fence", 409, old)
    assert [e["text"] for e in mcp_server.effects("send_email")] == ["from b"]
    receipts = await fetch_receipts(session, mcp_gateway.url, resource="mail/bob")
    assert [(r["fence"], r["status"], r["reject_code"]) for r in receipts] == [
        (new, "succeeded", None),
        (old, "rejected", "stale_fence"),
    ]
    assert receipts[1]["mcp"]["tool"] == "send_email"


async def test_a_retried_call_is_replayed_without_a_second_effect(
    mcp_gateway: GatewayProcess, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    fence = await acquire(session, mcp_gateway, "mail/dave", "run-d")
    meta = mcp_meta("mail/dave", fence, "run-d")
    async with mcp_client(mcp_gateway) as client:
        first = await client.call_tool("send_email", {"to": "erin", "text": "once"}, meta=meta)
        # the same call again, its arguments in another order: one operation
        again = await client.call_tool("send_email", {"text": "once", "to": "erin"}, meta=meta)
        assert again.content == first.content and not again.is_error
    assert len(mcp_server.effects("send_email")) == 1
    receipts = await fetch_receipts(session, mcp_gateway.url, resource="mail/dave")
    assert [r["status"] for r in receipts] == ["succeeded"]


async def test_a_failing_tool_leaves_a_failed_receipt(
    mcp_gateway: GatewayProcess, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    fence = await acquire(session, mcp_gateway, "mail/ops", "run-o")
    async with mcp_client(mcp_gateway, fenced_headers("mail/ops", fence)) as client:
        result = await client.call_tool("deploy", {"version": "v42"})
        assert result.is_error
    assert len(mcp_server.effects("deploy")) == 1
    receipts = await fetch_receipts(session, mcp_gateway.url, resource="mail/ops")
    assert [(r["status"], r["http_status"], r["mcp"]["tool"]) for r in receipts] == [
        ("failed", 200, "deploy")
    ]


async def test_an_sse_answer_is_relayed_and_a_broken_one_is_outcome_unknown(
    mcp_gateway: GatewayProcess, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    fence = await acquire(session, mcp_gateway, "mail/sse", "run-s")
    progress: list[float] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(value)

    async with mcp_client(mcp_gateway, fenced_headers("mail/sse", fence)) as client:
        sent = await client.call_tool(
            "send_with_progress", {"to": "finn"}, progress_callback=on_progress
        )
        assert not sent.is_error and progress == [1, 2]  # the events came through first
        with pytest.raises(MCPError):
            await client.call_tool("crash_midway", {"to": "gail"}, progress_callback=on_progress)
    assert len(mcp_server.effects("crash_midway")) == 1  # it acted, then its stream broke
    receipts = await fetch_receipts(session, mcp_gateway.url, resource="mail/sse")
    assert [(r["mcp"]["tool"], r["status"]) for r in receipts] == [
        ("send_with_progress", "succeeded"),
        ("crash_midway", "outcome_unknown"),
    ]
    assert receipts[1]["error"] == "response_incomplete"
