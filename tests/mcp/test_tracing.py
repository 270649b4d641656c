"""Spans of MCP tool calls (docs/contract.md §21) against the real MCP server: the gateway's
server span continues the trace context a tool call carries in `params._meta` (the MCP SDK's
own place for it), or the headers' when `_meta` has none, and the MCP server receives the
`traceparent` of the gateway's client span."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.client import GatewayClient
from tests.harness import GatewayFactory, GatewayProcess, fetch_receipts, wait_for
from tests.mcp.conftest import McpServerView, mcp_policy
from tests.mcp.test_tool_calls import mcp_client
from tests.tracing.otlp import CLIENT, SERVER, OtlpReceiver, ReceivedSpan, tracing_env

META_TRACE, HEADER_TRACE = "0af7651916cd43dd8448eb211c80319c", "5b8efff798038103d269b633813fc60c"


@pytest.fixture
async def otlp() -> AsyncIterator[OtlpReceiver]:
    async with OtlpReceiver() as receiver:
        yield receiver


async def test_a_tool_call_continues_the_trace_of_its_meta_or_its_headers(
    gateway_factory: GatewayFactory,
    mcp_server: McpServerView,
    otlp: OtlpReceiver,
    session: aiohttp.ClientSession,
) -> None:
    gateway: GatewayProcess = await gateway_factory(
        mcp_policy(mcp_server.url), extra_env=tracing_env(otlp)
    )
    header_parent = f"00-{HEADER_TRACE}-b7ad6b7169203331-01"
    async with (
        GatewayClient(gateway.url) as gw,
        gw.lease("mail/trace", owner="run-t", ttl_s=30) as lease,
        mcp_client(gateway, {"traceparent": header_parent}) as client,
    ):
        await client.list_tools()  # unfenced, traced from the headers
        meta = {"traceparent": f"00-{META_TRACE}-00f067aa0ba902b7-01", **lease.mcp_meta()}
        sent = await client.call_tool("send_email", {"to": "bob", "text": "hi"}, meta=meta)
        assert not sent.is_error
        looked = await client.call_tool("lookup", {"q": "x"})  # no _meta trace: the headers'
        assert not looked.is_error
    [receipt] = await fetch_receipts(session, gateway.url, resource="mail/trace")
    assert receipt["trace_id"] == META_TRACE

    def fenced_span() -> ReceivedSpan | None:
        found = [s for s in otlp.of_kind(SERVER) if s.attributes.get("fence_gateway.fence")]
        return found[0] if found else None

    await wait_for(lambda: fenced_span() is not None, timeout=10, what="the tool call's span")
    await otlp.wait_spans(SERVER, 3)  # list_tools, the tool call, lookup (and any handshake)
    fenced = fenced_span()
    assert fenced is not None and fenced.attributes["fence_gateway.receipt_id"] == receipt["id"]
    spans = otlp.of_kind(SERVER)
    assert (fenced.name, fenced.trace_id, fenced.parent_span_id) == (
        "POST /mail",
        META_TRACE,
        "00f067aa0ba902b7",
    )
    assert fenced.attributes["http.route"] == "/mail"
    assert fenced.attributes["fence_gateway.decision"] == "admitted"
    assert fenced.attributes["fence_gateway.outcome"] == "succeeded"
    assert fenced.attributes["fence_gateway.resource"] == "mail/trace"
    others = [s for s in spans if s is not fenced]
    assert {(s.trace_id, s.attributes["fence_gateway.decision"]) for s in others} == {
        (HEADER_TRACE, "unfenced")
    }
    # the MCP server got the gateway's client span as the parent of the tool call
    [client_span] = [s for s in otlp.of_kind(CLIENT) if s.parent_span_id == fenced.span_id]
    [call] = [r for r in mcp_server.requests() if "send_email" in r["body"]]
    assert call["headers"]["traceparent"] == f"00-{META_TRACE}-{client_span.span_id}-01"
