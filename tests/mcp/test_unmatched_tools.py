"""`unmatched_tools: refuse` (docs/contract.md §20) against the real MCP server: a tool call no
rule fences and no `unfenced_tools` glob names is refused `403 tool_not_allowed` in JSON-RPC,
never reaches the server and leaves no receipt; listed tools pass, fenced ones are fenced."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from mcp.shared.exceptions import MCPError

from gateway.client import GatewayClient
from gateway.core.mcp import FENCE_ERROR_CODE
from tests.harness import GatewayFactory, GatewayProcess, fetch_receipts, make_policy
from tests.mcp.conftest import MOUNT, McpServerView
from tests.mcp.test_tool_calls import mcp_client, refusal
from tests.mcp.test_wire import post, routing, rpc


def refusing_policy(url: str, **upstream: Any) -> dict[str, Any]:
    """Only `send_email` is fenced and only `lookup` listed as unfenced: `deploy` and
    `send_with_progress` (tools of the server the policy does not name) are refused."""
    return make_policy(
        url,
        [{"match": "mail/*", "tools": ["send_email"], "lease": {"issuer": "gateway"}}],
        name="mail",
        mount=MOUNT,
        mcp=True,
        unmatched_tools="refuse",
        unfenced_tools=["look*"],
        **upstream,
    )


@pytest.fixture
async def refusing_gateway(
    gateway_factory: GatewayFactory, mcp_server: McpServerView
) -> GatewayProcess:
    return await gateway_factory(refusing_policy(mcp_server.url))


async def test_a_tool_no_policy_names_is_refused_and_never_reaches_the_server(
    refusing_gateway: GatewayProcess, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    async with (
        GatewayClient(refusing_gateway.url) as gw,
        gw.lease("mail/alice", owner="run-1", ttl_s=30) as lease,
        mcp_client(refusing_gateway) as client,
    ):
        names = {tool.name for tool in (await client.list_tools()).tools}  # unfenced
        assert {"send_email", "lookup", "deploy", "send_with_progress"} <= names
        looked = await client.call_tool("lookup", {"q": "hi"})  # listed: no lease needed
        assert looked.structured_content == {"result": "HI"}
        sent = await client.call_tool(
            "send_email", {"to": "bob", "text": "hi"}, meta=lease.mcp_meta()
        )
        assert sent.structured_content == {"result": "sent to bob"}
        for tool, args in (("deploy", {"version": "v2"}), ("send_with_progress", {"to": "c"})):
            with pytest.raises(MCPError) as refused:  # a lease does not make it allowed
                await client.call_tool(tool, args, meta=lease.mcp_meta())
            problem = refusal(refused)
            assert (problem["code"], problem["status"], problem["title"]) == (
                "tool_not_allowed",
                403,
                "Tool not allowed",
            )
            assert tool in problem["detail"] and "unfenced_tools" in problem["detail"]
    # on the wire: the HTTP status of the refusal, a JSON-RPC error under the request's id
    call = rpc("call-7", "tools/call", {"name": "deploy", "arguments": {"version": "v3"}})
    status, headers, body = await post(
        session, refusing_gateway, call, routing("tools/call", "deploy")
    )
    assert status == 403 and headers["Content-Type"].startswith("application/json")
    assert body["id"] == "call-7" and body["error"]["code"] == FENCE_ERROR_CODE
    assert body["error"]["message"] == "Tool not allowed"
    data = body["error"]["data"]
    assert (data["type"], data["code"], data["status"]) == (
        "urn:fence-gateway:tool_not_allowed",
        "tool_not_allowed",
        403,
    )
    assert mcp_server.effects("deploy") == mcp_server.effects("send_with_progress") == []
    reached = [r["body"] for r in mcp_server.requests() if '"tools/call"' in r["body"]]
    assert len(reached) == 2 and not any('"deploy"' in body for body in reached)
    receipts = await fetch_receipts(session, refusing_gateway.url)
    assert [(r["status"], r["mcp"]["tool"]) for r in receipts] == [("succeeded", "send_email")]


async def test_by_default_an_unnamed_tool_passes_unfenced(
    gateway_factory: GatewayFactory, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    policy = refusing_policy(mcp_server.url)
    del policy["upstreams"][0]["unmatched_tools"]
    gateway = await gateway_factory(policy)
    async with mcp_client(gateway) as client:
        answer = await client.call_tool("deploy", {"version": "v4"})
    assert answer.is_error  # the tool ran (and failed, as it always does), without a lease
    assert [e["version"] for e in mcp_server.effects("deploy")] == ["v4"]
    assert await fetch_receipts(session, gateway.url) == []
