"""Fixtures for session tests: the WebSocket tool, and the policies that put it behind the
gateway (docs/contract.md §15). The `replicas` fixture of tests/replicas is offered here too,
for the session test that spans two replicas."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.harness import GatewayProcess, fenced_headers, fetch_receipts, make_policy
from tests.replicas.conftest import pg_url, replicas  # noqa: F401 - fixtures offered here
from tests.sessions.ws_upstream import WsConnection, WsUpstream


@pytest.fixture
async def ws_upstream() -> AsyncIterator[WsUpstream]:
    async with WsUpstream() as server:
        yield server


def ws_policy(url: str, *rules: dict[str, Any], **upstream: Any) -> dict[str, Any]:
    """One upstream taking upgrades, at /tool: `ext/*` fenced by external tokens, `gw/*` by
    leases the gateway issues (short TTLs), unless other rules are given."""
    return make_policy(
        url,
        rules
        or (
            {"match": "ext/*"},
            {"match": "gw/*", "lease": {"issuer": "gateway", "ttl_s": 30, "max_ttl_s": 60}},
        ),
        websocket=True,
        **upstream,
    )


async def connect(
    session: aiohttp.ClientSession,
    gateway: GatewayProcess,
    resource: str,
    fence: int | str,
    path: str = "/tool/ws",
    **kwargs: Any,
) -> aiohttp.ClientWebSocketResponse[Any]:
    """A fenced session through the gateway, pings and closes left to the test."""
    headers = {**fenced_headers(resource, fence), **kwargs.pop("headers", {})}
    ws: aiohttp.ClientWebSocketResponse[Any] = await session.ws_connect(
        f"{gateway.url}{path}",
        headers=headers,
        autoping=False,
        autoclose=False,
        max_msg_size=0,
        **kwargs,
    )
    return ws


async def keep_sending(ws: aiohttp.ClientWebSocketResponse[Any], sent: list[str]) -> None:
    """The old owner, paused in a model call no more: it sends as fast as it can until its
    socket is closed under it."""
    with contextlib.suppress(ConnectionError, aiohttp.ClientError, RuntimeError):
        for n in range(1_000_000):
            if ws.closed:
                return
            await ws.send_str(f"click {n}")
            sent.append(f"click {n}")
            await asyncio.sleep(0.001)


async def old_owner_sending(
    session: aiohttp.ClientSession,
    gateway: GatewayProcess,
    ws_upstream: WsUpstream,
    resource: str,
    fence: int,
    received: int = 20,
) -> tuple[aiohttp.ClientWebSocketResponse[Any], WsConnection, list[str], asyncio.Task[None]]:
    """A session whose owner keeps sending (`keep_sending`), once the tool has `received` of
    its messages: the client's socket, the tool's one new connection, what was sent so far,
    and the sending task."""
    before = len(ws_upstream.connections)
    ws = await connect(session, gateway, resource, fence)
    sent: list[str] = []
    sender = asyncio.create_task(keep_sending(ws, sent))
    await ws_upstream.wait_connections(before + 1)
    (conn,) = ws_upstream.connections[before:]
    await ws_upstream.wait_messages(conn, received)
    return ws, conn, sent, sender


def assert_nothing_after(old: WsConnection, at_seq: int, at_time: float) -> None:
    """No message of the old session reached the tool after the newer call or session did."""
    assert old.messages, "the old session relayed nothing before the takeover"
    assert max(m.seq for m in old.messages) < at_seq
    assert max(m.received_at for m in old.messages) <= at_time


async def next_message(ws: aiohttp.ClientWebSocketResponse[Any], timeout: float = 5.0) -> Any:
    return await ws.receive(timeout=timeout)


async def closed_with(ws: aiohttp.ClientWebSocketResponse[Any], timeout: float = 5.0) -> Any:
    """The close frame the gateway sent (skipping any message still on its way), answered
    as a client does."""
    while True:
        message = await ws.receive(timeout=timeout)
        if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
            await ws.close()
            return message


async def settled_receipts(
    session: aiohttp.ClientSession, gateway_url: str, timeout: float = 5.0, **filters: Any
) -> list[dict[str, Any]]:
    """The receipts once none is `pending`: a session's end is recorded just after both of
    its sides were closed, so a test that saw the close may look a moment too early."""
    deadline = time.monotonic() + timeout
    while True:
        receipts = await fetch_receipts(session, gateway_url, **filters)
        if all(r["status"] != "pending" for r in receipts) or time.monotonic() > deadline:
            return receipts
        await asyncio.sleep(0.02)
