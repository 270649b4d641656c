"""MCP tool calls at their edges (docs/contract.md §16): clients with keys (a refusal before
the body is read is a JSON-RPC error too, and `lease.mcp_headers()` carries the key), an SSE
answer kept for replay, a tool call that outlives `timeout_s`, and the receipt on the console.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import aiohttp
import pytest
from mcp.shared.exceptions import MCPError

from gateway.client import GatewayClient
from gateway.core.mcp import FENCE_ERROR_CODE, LEASE_META_KEY
from tests.harness import GatewayFactory, GatewayProcess, fenced_headers, fetch_receipts
from tests.mcp.conftest import MOUNT, McpServerView, mcp_policy
from tests.mcp.test_tool_calls import acquire, mcp_client, refusal

CLIENTS = f"""\
clients:
  - name: mailer
    key_sha256: "{hashlib.sha256(b"k-mailer").hexdigest()}"
    roles: [agent]
    resources: ["mail/*"]
  - name: root
    key_sha256: "{hashlib.sha256(b"k-root").hexdigest()}"
    roles: [admin]
"""


async def test_with_clients_a_keyless_call_is_a_jsonrpc_error_and_mcp_headers_carry_the_key(
    gateway_factory: GatewayFactory, mcp_server: McpServerView, tmp_path: Path
) -> None:
    clients = tmp_path / "clients.yaml"
    clients.write_text(CLIENTS)
    gateway = await gateway_factory(
        mcp_policy(mcp_server.url), extra_env={"GATEWAY_CLIENTS": str(clients)}
    )
    # no key: the body is checked first, then the caller (docs/contract.md §16), so the
    # error answers the request's id, and a body that disagrees with its headers is a 400
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    async with aiohttp.ClientSession() as anonymous:
        async with anonymous.post(f"{gateway.url}{MOUNT}/mcp", json=listing) as resp:
            assert resp.status == 401
            assert resp.headers["Content-Type"].startswith("application/json")
            body = await resp.json()
        assert body["id"] == 1 and body["error"]["code"] == FENCE_ERROR_CODE
        assert body["error"]["data"]["code"] == "unauthenticated"
        async with anonymous.post(
            f"{gateway.url}{MOUNT}/mcp", json=listing, headers={"Mcp-Method": "tools/call"}
        ) as resp:
            assert resp.status == 400
            body = await resp.json()
        assert body["id"] == 1 and body["error"]["data"]["code"] == "invalid_request"
    async with (
        GatewayClient(gateway.url, key="k-mailer") as gw,
        gw.lease("mail/keyed", owner="run-k", ttl_s=30) as lease,
        mcp_client(gateway, lease.mcp_headers()) as client,
    ):
        assert (await client.call_tool("lookup", {"q": "x"})).structured_content == {"result": "X"}
        sent = await client.call_tool("send_email", {"to": "kim", "text": "keyed"})
        assert not sent.is_error
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer k-root"}) as admin:
        receipts = await fetch_receipts(admin, gateway.url, resource="mail/keyed")
    assert [(r["client"], r["owner"], r["status"]) for r in receipts] == [
        ("mailer", "run-k", "succeeded")
    ]
    assert len(mcp_server.effects("send_email")) == 1


async def test_an_sse_answer_is_replayed_as_json(
    mcp_gateway: GatewayProcess, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    fence = await acquire(session, mcp_gateway, "mail/again", "run-a")
    progress: list[float] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(value)

    async with mcp_client(mcp_gateway, fenced_headers("mail/again", fence)) as client:
        first = await client.call_tool(
            "send_with_progress", {"to": "ida"}, progress_callback=on_progress
        )
        again = await client.call_tool(
            "send_with_progress", {"to": "ida"}, progress_callback=on_progress
        )
    assert progress == [1, 2]  # the replay is the stored answer alone, not the stream
    assert again.content == first.content and not again.is_error
    assert len(mcp_server.effects("send_with_progress")) == 1


async def test_a_tool_call_past_timeout_s_is_outcome_unknown(
    gateway_factory: GatewayFactory, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    gateway = await gateway_factory(mcp_policy(mcp_server.url, timeout_s=0.5))
    fence = await acquire(session, gateway, "mail/slow", "run-s")

    async def ignore(value: float, total: float | None, message: str | None) -> None:
        pass

    async with mcp_client(gateway, fenced_headers("mail/slow", fence)) as client:
        # no progress asked for: the server answers JSON after its pause, too late
        with pytest.raises(MCPError) as late:
            await client.call_tool("send_slowly", {"to": "jo", "seconds": 1})
        assert refusal(late)["code"] == "upstream_timeout"
        # progress asked for: the answer is an SSE stream whose response comes too late
        with pytest.raises(MCPError):
            await client.call_tool(
                "send_slowly", {"to": "kai", "seconds": 1}, progress_callback=ignore
            )
    # (the gateway gave up on both and closed their connections, which cancels them at the
    # server: whether a call ran is what outcome_unknown leaves to a reconciler)
    receipts = await fetch_receipts(session, gateway.url, resource="mail/slow")
    assert [(r["status"], r["error"]) for r in receipts] == [
        ("outcome_unknown", "upstream_timeout"),
        ("outcome_unknown", "upstream_timeout"),
    ]
    async with session.get(f"{gateway.url}/_gateway/console/queue") as page:
        assert page.status == 200
        text = await page.text()
    assert "send_slowly" in text and "MCP tool" in text


async def test_a_signed_external_fence_travels_in_meta(
    gateway_factory: GatewayFactory, mcp_server: McpServerView, session: aiohttp.ClientSession
) -> None:
    policy = mcp_policy(mcp_server.url)
    policy["resources"][0]["lease"] = {"issuer": "external", "hmac_secret_env": "MCP_SECRET"}
    gateway = await gateway_factory(policy, extra_env={"MCP_SECRET": "s3cret"})
    signed = hmac.new(b"s3cret", b"mail/ext\n5", hashlib.sha256).hexdigest()
    lease = {"resource": "mail/ext", "fence": 5, "owner": "etcd-run"}
    async with mcp_client(gateway) as client:
        with pytest.raises(MCPError) as unsigned:
            await client.call_tool(
                "send_email", {"to": "u", "text": "t"}, meta={LEASE_META_KEY: lease}
            )
        assert refusal(unsigned)["code"] == "bad_fence_signature"
        sent = await client.call_tool(
            "send_email",
            {"to": "u", "text": "t"},
            meta={LEASE_META_KEY: {**lease, "signature": signed}},
        )
        assert not sent.is_error
    receipts = await fetch_receipts(session, gateway.url, resource="mail/ext")
    assert [(r["status"], r["reject_code"], r["owner"], r["mcp"]["tool"]) for r in receipts] == [
        ("rejected", "bad_fence_signature", "etcd-run", "send_email"),
        ("succeeded", None, "etcd-run", "send_email"),
    ]
    assert len(mcp_server.effects("send_email")) == 1
