"""How sessions end besides a close or a takeover (docs/contract.md §15): a gateway killed with
a session open leaves it `outcome_unknown`; SIGTERM closes sessions (1001, `shutdown`) within
the grace; a message over `max_message_bytes` closes with 1009 (`limit`) without being
relayed; a session with no message or client ping for `session_idle_timeout_s` closes with
1001 (`idle`), counted from its opening, not its admission; and a slow reader on either side
slows the other instead of making the gateway buffer without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

from tests.harness import GatewayFactory, GatewayProcess, fenced_headers, fetch_receipts, free_port
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


class SlowHandshakeTool:
    """A WebSocket tool that takes `delay_s` to answer an upgrade, then echoes text."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> SlowHandshakeTool:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}/api"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(self.delay_s)
        ws = web.WebSocketResponse(autoping=False, autoclose=False, max_msg_size=0)
        await ws.prepare(request)
        while True:
            message = await ws.receive()
            if message.type is WSMsgType.TEXT:
                await ws.send_str(message.data)
            elif message.type is WSMsgType.CLOSE:
                with contextlib.suppress(Exception):
                    await ws.close(code=message.data or 1000)
                break
            elif message.type not in (WSMsgType.BINARY, WSMsgType.PING, WSMsgType.PONG):
                break
        return ws


async def test_the_idle_clock_starts_when_the_session_opens_not_at_admission(
    gateway_factory: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    """§15: a session closes as idle after `session_idle_timeout_s` with no message or client
    ping either way. A session that took longer than that to open (here a slow handshake,
    well within the upstream's `timeout_s`; equally a wait for an older session or call of
    the resource to leave) has had no chance to send anything: it must not be closed as idle
    the moment its upgrade is answered."""
    async with SlowHandshakeTool(delay_s=1.5) as tool:
        gw = await gateway_factory(ws_policy(tool.url, session_idle_timeout_s=1.0))
        ws: aiohttp.ClientWebSocketResponse[Any] = await session.ws_connect(
            f"{gw.url}/tool/ws",
            headers=fenced_headers("ext/idleclock", 1),
            autoping=False,
            autoclose=False,
            max_msg_size=0,
        )
        await ws.send_str("first")  # at once: the session has been open for no time at all
        message = await ws.receive(timeout=5)
        with contextlib.suppress(Exception):
            await ws.close()
        (receipt,) = await settled_receipts(session, gw.url, resource="ext/idleclock")
        got = (message.type, message.data, receipt["session"]["closed_by"])
        assert got == (WSMsgType.TEXT, "first", "client"), got
