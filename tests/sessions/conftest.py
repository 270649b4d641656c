"""Fixtures for session tests: the WebSocket tool, and the policies that put it behind the
gateway (docs/contract.md §15). The `replicas` fixture of tests/replicas is offered here too,
for the session test that spans two replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.harness import GatewayProcess, fenced_headers, fetch_receipts, make_policy
from tests.replicas.conftest import pg_url, replicas  # noqa: F401 - fixtures offered here
from tests.sessions.ws_upstream import WsUpstream


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
