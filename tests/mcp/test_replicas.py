"""MCP tool calls through two replicas on PostgreSQL (docs/contract.md §14, §16): a tool call
retried through the other replica is replayed from the shared store, a stale owner is refused
by either, and the receipts carry `mcp` on PostgreSQL as on SQLite."""

from __future__ import annotations

import aiohttp
import pytest
from mcp.shared.exceptions import MCPError

from gateway.client import mcp_meta
from tests.harness import fenced_headers, fetch_receipts
from tests.mcp.conftest import McpServerView, mcp_policy
from tests.mcp.test_tool_calls import acquire, mcp_client, refusal
from tests.replicas.conftest import Replicas, pg_url, replicas  # noqa: F401 - fixtures


async def test_a_tool_call_retried_through_another_replica_is_replayed_and_a_stale_one_refused(
    replicas: Replicas,  # noqa: F811 - the fixture
    mcp_server: McpServerView,
    session: aiohttp.ClientSession,
) -> None:
    a, b = await replicas(mcp_policy(mcp_server.url))
    fence = await acquire(session, a, "mail/pg", "run-1")
    meta = mcp_meta("mail/pg", fence, "run-1")
    async with mcp_client(a) as through_a:
        first = await through_a.call_tool("send_email", {"to": "pat", "text": "once"}, meta=meta)
        assert not first.is_error
    async with mcp_client(b) as through_b:  # the agent's retry lands on the other replica
        again = await through_b.call_tool("send_email", {"text": "once", "to": "pat"}, meta=meta)
        assert again.content == first.content and not again.is_error
    assert len(mcp_server.effects("send_email")) == 1

    # the lease is taken over through B; the old owner, still on A, is refused there
    async with session.delete(f"{b.url}/_gateway/v1/leases/mail/pg?force=true") as resp:
        assert resp.status == 204
    newer = await acquire(session, b, "mail/pg", "run-2")
    async with mcp_client(a, fenced_headers("mail/pg", fence)) as old_owner:
        with pytest.raises(MCPError) as stale:
            await old_owner.call_tool("send_email", {"to": "pat", "text": "late"})
    assert refusal(stale)["code"] == "stale_fence"
    assert [e["text"] for e in mcp_server.effects("send_email")] == ["once"]

    receipts = await fetch_receipts(session, b.url, resource="mail/pg")
    assert [(r["fence"], r["status"], r["mcp"]["tool"]) for r in receipts] == [
        (fence, "succeeded", "send_email"),
        (fence, "rejected", "send_email"),
    ]
    assert newer > fence
