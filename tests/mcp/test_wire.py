"""MCP over raw HTTP through the gateway (docs/contract.md §16): the 2026-07-28 revision's
headers (`Mcp-Method`, `Mcp-Name`, `MCP-Protocol-Version`) checked against the body, refusals
in JSON-RPC, a replay under the retrying request's id, an SSE answer whose client leaves,
and the 2025 revisions (sessions, GET stream, DELETE) passing through with the SDK's client.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import time
from typing import Any

import aiohttp
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from gateway.core.mcp import FENCE_ERROR_CODE, LEASE_META_KEY
from tests.harness import GatewayProcess, fenced_headers, fetch_receipts
from tests.mcp.conftest import MOUNT, McpServerView
from tests.mcp.test_tool_calls import acquire

VERSION = "2026-07-28"


def rpc(request_id: Any, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """A 2026-07-28 request: its envelope in `params._meta`."""
    meta = {
        "io.modelcontextprotocol/protocolVersion": VERSION,
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": method,
        "params": {**params, "_meta": meta},
    }


def routing(method: str, name: str | None = None) -> dict[str, str]:
    headers = {
        "MCP-Protocol-Version": VERSION,
        "Mcp-Method": method,
        "Accept": "application/json, text/event-stream",
    }
    if name is not None:
        headers["Mcp-Name"] = name
    return headers


async def post(
    session: aiohttp.ClientSession, gateway: GatewayProcess, body: Any, headers: dict[str, str]
) -> tuple[int, Any, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(
        f"{gateway.url}{MOUNT}/mcp",
        data=data,
        headers={"Content-Type": "application/json", **headers},
    ) as resp:
        return resp.status, resp.headers, json.loads(await resp.read())


async def test_headers_that_disagree_with_the_body_and_batches_are_refused_in_jsonrpc(
    mcp_gateway: GatewayProcess, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    fence = await acquire(session, mcp_gateway, "mail/hdr", "run-h")
    lease = fenced_headers("mail/hdr", fence)
    call = rpc(5, "tools/call", {"name": "send_email", "arguments": {"to": "a", "text": "b"}})
    # a tool call dressed up as a read-only one, by its headers or by its name header
    for headers in (routing("tools/list"), routing("tools/call", "lookup")):
        status, answer_headers, body = await post(session, mcp_gateway, call, {**lease, **headers})
        assert status == 400 and answer_headers["Content-Type"].startswith("application/json")
        assert body["id"] == 5 and body["error"]["code"] == FENCE_ERROR_CODE
        assert body["error"]["data"]["code"] == "invalid_request"
        assert body["error"]["message"] == body["error"]["data"]["title"] == "Invalid request"
    # a batch holding a tool call: refused whole, id null
    batch = [rpc(1, "tools/list", {}), call]
    status, _, body = await post(session, mcp_gateway, batch, lease)
    assert (status, body["id"], body["error"]["data"]["code"]) == (400, None, "invalid_request")
    # a member named twice could read as another message elsewhere
    doubled = b'{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call","params":{}}'
    status, _, body = await post(session, mcp_gateway, doubled, lease)
    assert (status, body["error"]["data"]["code"]) == (400, "invalid_request")
    # the headers carry a lease: they alone count, and the _meta entry is removed all the same
    with_meta = rpc(6, "tools/call", {"name": "lookup", "arguments": {"q": "m"}})
    with_meta["params"]["_meta"][LEASE_META_KEY] = {"resource": "mail/hdr", "fence": 999}
    status, _, body = await post(
        session, mcp_gateway, with_meta, {**lease, **routing("tools/call", "lookup")}
    )
    assert status == 200 and body["result"]["structuredContent"] == {"result": "M"}
    # a compressed body could hide a tool call from the gateway, not from the server
    gzipped = gzip.compress(json.dumps(call).encode())
    status, _, body = await post(
        session, mcp_gateway, gzipped, {**lease, "Content-Encoding": "gzip"}
    )
    assert (status, body["error"]["data"]["code"]) == (400, "invalid_request")
    # a name header in the revision's base64 form agrees with the body
    encoded = "=?base64?" + base64.b64encode(b"send_email").decode() + "?="
    status, _, body = await post(
        session, mcp_gateway, call, {**lease, **routing("tools/call", encoded)}
    )
    assert status == 200 and body["result"]["structuredContent"] == {"result": "sent to a"}
    assert len(mcp_server.effects("send_email")) == 1
    reached = [r["body"] for r in mcp_server.requests() if '"tools/call"' in r["body"]]
    assert len([body for body in reached if "send_email" in body]) == 1
    assert len(reached) == 2 and not any(LEASE_META_KEY in body for body in reached)


async def test_a_replay_answers_with_the_retrying_requests_id(
    mcp_gateway: GatewayProcess, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    fence = await acquire(session, mcp_gateway, "mail/rp", "run-r")
    headers = {**fenced_headers("mail/rp", fence), **routing("tools/call", "send_email")}
    first_call = rpc(7, "tools/call", {"name": "send_email", "arguments": {"to": "x", "text": "y"}})
    # refused by the server before the tool ran (its version header disagrees with the body):
    # failed, and the retry that follows is a new attempt, not this refusal replayed
    refused_headers = {**headers, "MCP-Protocol-Version": "2025-11-25"}
    status, _, refused = await post(session, mcp_gateway, first_call, refused_headers)
    assert status == 400 and "error" in refused and mcp_server.effects("send_email") == []
    status, first_headers, first = await post(session, mcp_gateway, first_call, headers)
    assert status == 200 and first["id"] == 7
    # the retry: another id, its arguments written in another order and spacing
    retry = json.dumps(
        rpc("retry-8", "tools/call", {"arguments": {"text": "y", "to": "x"}, "name": "send_email"}),
        indent=2,
    ).encode()
    status, again_headers, again = await post(session, mcp_gateway, retry, headers)
    assert status == 200 and again_headers["Idempotent-Replayed"] == "true"
    assert again["id"] == "retry-8" and again["result"] == first["result"]
    assert again_headers["X-Receipt-Id"] == first_headers["X-Receipt-Id"]
    assert again_headers["Idempotency-Key"] == first_headers["Idempotency-Key"]
    assert len(mcp_server.effects("send_email")) == 1
    receipts = await fetch_receipts(session, mcp_gateway.url, resource="mail/rp")
    assert [(r["status"], r["http_status"], r["attempt"]) for r in receipts] == [
        ("failed", 400, 1),
        ("succeeded", 200, 2),
    ]


async def test_an_sse_outcome_is_recorded_first_and_a_leaving_client_cancels_nothing(
    mcp_gateway: GatewayProcess, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    fence = await acquire(session, mcp_gateway, "mail/gone", "run-g")
    streamed = rpc(2, "tools/call", {"name": "send_with_progress", "arguments": {"to": "y"}})
    streamed["params"]["_meta"]["progressToken"] = "p-0"
    async with session.post(
        f"{mcp_gateway.url}{MOUNT}/mcp",
        json=streamed,
        headers={
            **fenced_headers("mail/gone", fence),
            **routing("tools/call", "send_with_progress"),
        },
    ) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [await resp.content.readuntil(b"\r\n\r\n") for _ in range(3)]
        assert [b'"result"' in event for event in events] == [False, False, True]
        # the answering event has arrived: its outcome was recorded before it left
        async with session.get(
            f"{mcp_gateway.url}/_gateway/v1/receipts/{resp.headers['X-Receipt-Id']}"
        ) as got:
            assert (await got.json())["status"] == "succeeded"
    call = rpc(3, "tools/call", {"name": "send_slowly", "arguments": {"to": "z", "seconds": 1}})
    call["params"]["_meta"]["progressToken"] = "p-1"
    async with session.post(
        f"{mcp_gateway.url}{MOUNT}/mcp",
        json=call,
        headers={**fenced_headers("mail/gone", fence), **routing("tools/call", "send_slowly")},
    ) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        receipt_id = resp.headers["X-Receipt-Id"]
        first = await resp.content.readuntil(b"\r\n\r\n")
        assert b"notifications/progress" in first
        resp.connection.close()  # the client goes away mid-stream  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        async with session.get(f"{mcp_gateway.url}/_gateway/v1/receipts/{receipt_id}") as got:
            receipt = await got.json()
        if receipt["status"] != "pending":
            break
        await asyncio.sleep(0.1)
    assert (receipt["status"], receipt["mcp"]) == (
        "succeeded",
        {"tool": "send_slowly", "jsonrpc_id": 3},
    )
    assert [e["to"] for e in mcp_server.effects("send_slowly")] == ["z"]


async def test_the_2025_revisions_pass_through_intact(
    mcp_gateway: GatewayProcess, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    fence = await acquire(session, mcp_gateway, "mail/old", "run-o")
    http = httpx2.AsyncClient(headers=fenced_headers("mail/old", fence), timeout=20.0)
    url = f"{mcp_gateway.url}{MOUNT}/mcp"
    async with Client(streamable_http_client(url, http_client=http), mode="legacy") as client:
        assert client.session.protocol_version == "2025-11-25"
        assert (await client.call_tool("lookup", {"q": "a"})).structured_content == {"result": "A"}
        sent = await client.call_tool("send_email", {"to": "old", "text": "handshake"})
        assert not sent.is_error
    requests = mcp_server.requests()
    methods = [r["request"] for r in requests]
    # the session's GET stream went through, and the session was ended through the gateway
    assert {"POST", "GET", "DELETE"} <= set(methods)
    sessions = {r["headers"].get("mcp-session-id") for r in requests[1:]}
    assert len(sessions) == 1 and None not in sessions  # one session, its id passed on
    receipts = await fetch_receipts(session, mcp_gateway.url, resource="mail/old")
    assert [(r["status"], r["mcp"]["tool"]) for r in receipts] == [("succeeded", "send_email")]
    assert len(mcp_server.effects("send_email")) == 1
