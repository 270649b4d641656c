"""How sessions end besides a close or a takeover (docs/contract.md §15): a gateway killed with
a session open leaves it `outcome_unknown`; SIGTERM closes sessions (1001, `shutdown`) within
the grace; a message over `max_message_bytes` closes with 1009 (`limit`) without being
relayed; a session with no message or client ping for `session_idle_timeout_s` closes with
1001 (`idle`); and a slow reader on either side slows the other instead of making the
gateway buffer without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import WSMsgType

from tests.harness import GatewayFactory, GatewayProcess, fetch_receipts
from tests.sessions.conftest import closed_with, connect, next_message, settled_receipts, ws_policy
from tests.sessions.ws_upstream import WsUpstream

LIMIT = 64 * 1024
IDLE_S = 0.6


async def test_slow_readers_then_kill_9_with_the_session_open(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    """A session relayed under backpressure both ways; then the gateway dies with it open:
    its receipt is left `pending`, and recovery makes it `outcome_unknown`."""
    gw = await gateway_factory(ws_policy(ws_upstream.url))
    ws = await connect(session, gw, "ext/k", 1)
    receipt_id = ws._response.headers["X-Receipt-Id"]
    await _slow_readers(gw, ws_upstream, ws)
    await gw.kill9()
    gone = await ws.receive(timeout=5)
    assert gone.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.ERROR)
    await gw.restart()
    receipts = await fetch_receipts(session, gw.url, resource="ext/k")
    (receipt,) = [r for r in receipts if r["id"] == receipt_id]
    assert (receipt["status"], receipt["error"], receipt["http_status"]) == (
        "outcome_unknown",
        "gateway_restarted",
        101,
    )
    assert receipt["session"]["opened_at"] is not None
    assert receipt["session"]["closed_at"] is None  # which messages acted: a reconciler's call


async def test_sigterm_closes_open_sessions_within_the_grace(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    gw = await gateway_factory(ws_policy(ws_upstream.url))
    sockets = [await connect(session, gw, f"ext/s{n}", 1) for n in range(2)]
    ids = [ws._response.headers["X-Receipt-Id"] for ws in sockets]
    for ws in sockets:
        await ws.send_str("hello")
        await next_message(ws)
    started = time.monotonic()
    stopping = asyncio.create_task(gw.terminate())
    closes = [await closed_with(ws) for ws in sockets]
    assert await stopping == 0
    assert time.monotonic() - started < 5  # the grace is 10 s: sessions did not run it out
    assert [(c.data, c.extra) for c in closes] == [(1001, "shutdown")] * 2
    assert sorted(c.close_code for c in ws_upstream.connections) == [1001, 1001]
    await gw.start()
    for receipt_id in ids:
        async with session.get(f"{gw.url}/_gateway/v1/receipts/{receipt_id}") as answer:
            receipt = await answer.json()
        assert receipt["status"] == "succeeded"
        assert (receipt["session"]["closed_by"], receipt["session"]["close_code"]) == (
            "shutdown",
            1001,
        )


async def test_a_message_too_large_and_an_idle_session(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    gw = await gateway_factory(
        ws_policy(ws_upstream.url, max_message_bytes=LIMIT, session_idle_timeout_s=IDLE_S)
    )
    await _too_large_either_way(gw, ws_upstream, session)
    await _idle(gw, ws_upstream, session)
    receipts = await settled_receipts(session, gw.url)
    ended = sorted(
        (r["resource"], r["session"]["closed_by"], r["session"]["close_code"])
        for r in receipts
        if r["session"] and r["status"] == "succeeded"
    )
    assert ended == [
        ("ext/big-in", "limit", 1009),
        ("ext/big-out", "limit", 1009),
        ("ext/idle", "idle", 1001),
    ]


async def _too_large_either_way(
    gw: GatewayProcess, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    ws = await connect(session, gw, "ext/big-in", 1)
    await ws.send_bytes(b"a" * LIMIT)  # exactly the limit: relayed
    assert len((await next_message(ws)).data) == LIMIT
    await ws.send_bytes(b"b" * (LIMIT + 1))
    closed = await closed_with(ws)
    assert closed.data == 1009
    conn = ws_upstream.connections[-1]
    await ws_upstream.wait_ended(conn)
    assert conn.close_code == 1009
    assert [len(m.data) for m in conn.messages] == [LIMIT]  # the large one never reached it

    ws = await connect(session, gw, "ext/big-out", 1)
    await ws_upstream.wait_connections(2)
    conn = ws_upstream.connections[-1]
    await conn.ws.send_bytes(b"c" * (LIMIT + 1))
    closed = await closed_with(ws)
    assert closed.data == 1009
    await ws_upstream.wait_ended(conn)
    assert conn.close_code == 1009


async def _idle(
    gw: GatewayProcess, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    """Client pings keep a session alive; with none, and no message, it closes."""
    ws = await connect(session, gw, "ext/idle", 1)
    started = time.monotonic()
    for _ in range(5):  # 1 s of pings, 0.2 s apart: longer than the idle timeout
        await asyncio.sleep(0.2)
        await ws.ping(b"still here")
        assert (await next_message(ws)).type is WSMsgType.PONG
    last = time.monotonic()
    closed = await closed_with(ws, timeout=5)
    quiet = time.monotonic() - last
    assert (closed.data, closed.extra) == (1001, "idle")
    assert last - started >= 1.0 and IDLE_S - 0.1 <= quiet < IDLE_S + 1.0, quiet


async def _slow_readers(
    gw: GatewayProcess, ws_upstream: WsUpstream, ws: aiohttp.ClientWebSocketResponse[Any]
) -> None:
    """Backpressure both ways: a side that stops reading stops the other side's writes after
    what the sockets' buffers hold, and the gateway's own memory stays put."""
    await ws_upstream.wait_connections(1)
    conn = ws_upstream.connections[-1]
    rss_before = _rss(gw)
    chunk = b"z" * (LIMIT - 1)

    # the tool stops reading: the client's sends stall
    ws_upstream.echo, ws_upstream.reading = False, False
    sent_in = await _push_for(lambda: ws.send_bytes(chunk), 1.0)
    # the client stops reading (it just does not receive): the tool's sends stall
    pushed_out = await _push_for(lambda: conn.ws.send_bytes(chunk), 1.0)
    rss_peak = _rss(gw)
    assert sent_in < 48 * 1024 * 1024, sent_in  # sockets' buffers, not an unbounded queue
    assert pushed_out < 48 * 1024 * 1024, pushed_out
    assert rss_peak - rss_before < 24 * 1024 * 1024, (rss_before, rss_peak)

    # both read again: everything arrives, whole and in order
    ws_upstream.reading = True
    await ws_upstream.wait_messages(conn, sent_in // len(chunk), timeout=10)
    received = 0
    while received < pushed_out:
        message = await next_message(ws, timeout=10)
        assert message.data == chunk
        received += len(message.data)
    assert received == pushed_out


async def _push_for(send: Any, seconds: float) -> int:
    """Bytes handed to the socket by `send` (a 64 KiB message each) within `seconds`. A
    message counts once its send began: aiohttp writes the whole frame, then waits for the
    socket to drain."""
    total = 0

    async def loop() -> None:
        nonlocal total
        while True:
            total += LIMIT - 1
            await send()

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(loop(), seconds)
    return total


def _rss(gw: GatewayProcess) -> int:
    assert gw.proc is not None
    status = Path(f"/proc/{gw.proc.pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024
