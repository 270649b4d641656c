"""A session relays exactly (docs/contract.md §15): text and binary messages both ways, in
order and unchanged (empty, Unicode, fragmented, 5 MiB), pings and pongs, close codes and
reasons passed on from either side, the subprotocol agreed; its receipt counts what went
through. And an upgrade is fenced before anything reaches the tool: a stale or malformed one
is refused in HTTP, with no upstream connection at all.

Real processes: the gateway is `python -m gateway serve`, the tool a real aiohttp server.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from typing import Any

import aiohttp
from aiohttp import WSMsgType

from tests.harness import (
    GatewayFactory,
    call,
    fenced_headers,
    fetch_receipts,
    free_port,
    make_policy,
    problem,
)
from tests.sessions.conftest import closed_with, connect, next_message, ws_policy
from tests.sessions.ws_upstream import Refusal, WsUpstream, send_close

LARGE = os.urandom(5 * 1024 * 1024)


async def test_messages_pass_both_ways_unchanged_in_order_and_are_counted(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    ws_upstream.protocol = "cdp.v1"
    gw = await gateway_factory(ws_policy(ws_upstream.url))
    ws = await connect(
        session,
        gw,
        "ext/a",
        3,
        path="/tool/devtools/browser/b1?trace=1",
        protocols=("other", "cdp.v1"),
        headers={"Origin": "http://agent.local", "X-Idempotency": "kept"},
    )
    assert ws.protocol == "cdp.v1"
    receipt_id = ws._response.headers["X-Receipt-Id"]
    assert ws._response.headers["X-Fence-Token"] == "3"
    sent: list[tuple[WSMsgType, Any]] = [
        (WSMsgType.TEXT, "hello"),
        (WSMsgType.TEXT, ""),
        (WSMsgType.TEXT, "ünïcødé ✓ 🚀"),
        (WSMsgType.BINARY, b"\x00\x01\xff"),
        (WSMsgType.BINARY, b""),
        (WSMsgType.BINARY, LARGE),
        (WSMsgType.TEXT, "x" * (1024 * 1024 + 7)),
    ]
    for kind, data in sent:
        await (ws.send_str(data) if kind is WSMsgType.TEXT else ws.send_bytes(data))
    echoed = [await next_message(ws) for _ in sent]
    assert [(m.type, m.data) for m in echoed] == sent
    await ws.ping(b"are you there")
    pong = await next_message(ws)
    assert (pong.type, pong.data) == (WSMsgType.PONG, b"are you there")

    (conn,) = ws_upstream.connections
    assert [(m.kind, m.data) for m in conn.messages] == [
        ("text" if kind is WSMsgType.TEXT else "binary", data.encode() if isinstance(data, str)
         else data)
        for kind, data in sent
    ] + [("ping", b"are you there")]  # fmt: skip
    # what the tool was told, and not told
    assert conn.path_qs == "/api/devtools/browser/b1?trace=1"
    assert conn.headers["X-Fence-Token"] == "3" and conn.headers["X-Lease-Resource"] == "ext/a"
    assert conn.headers["X-Receipt-Id"] == receipt_id
    assert conn.headers["Origin"] == "http://agent.local"
    assert conn.headers["Host"] == ws_upstream.url.split("/")[2]
    assert "Idempotency-Key" not in conn.headers

    # the client closes with its own code and reason: the tool gets both
    await ws.close(code=4001, message=b"done here")
    await ws_upstream.wait_ended(conn)
    assert (conn.close_code, conn.close_reason) == (4001, "done here")
    receipt = await _settled(session, gw.url, receipt_id)
    assert (receipt["kind"], receipt["status"], receipt["http_status"]) == (
        "session",
        "succeeded",
        101,
    )
    assert receipt["path"] == "/devtools/browser/b1?trace=1" and receipt["method"] == "GET"
    text_bytes = sum(len(d.encode()) for k, d in sent if k is WSMsgType.TEXT)
    binary_bytes = sum(len(d) for k, d in sent if k is WSMsgType.BINARY)
    assert {k: v for k, v in receipt["session"].items() if k not in ("opened_at", "closed_at")} == {
        "closed_by": "client",
        "close_code": 4001,
        "messages_in": len(sent),
        "messages_out": len(sent),
        "bytes_in": text_bytes + binary_bytes,
        "bytes_out": text_bytes + binary_bytes,
    }
    assert receipt["session"]["opened_at"] <= receipt["session"]["closed_at"]


async def test_the_tool_closing_passes_its_code_on(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    gw = await gateway_factory(ws_policy(ws_upstream.url))
    ws = await connect(session, gw, "ext/a", 1)
    await ws_upstream.wait_connections(1)
    await send_close(ws_upstream.connections[0], 4100, b"target closed")
    closed = await closed_with(ws)
    assert (closed.type, closed.data, closed.extra) == (WSMsgType.CLOSE, 4100, "target closed")
    await ws.close()
    receipt_id = ws._response.headers["X-Receipt-Id"]
    session_of = (await _settled(session, gw.url, receipt_id))["session"]
    assert (session_of["closed_by"], session_of["close_code"]) == ("upstream", 4100)


async def test_a_fragmented_message_goes_on_whole_with_a_ping_between_its_parts(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream
) -> None:
    gw = await gateway_factory(ws_policy(ws_upstream.url))
    reader, writer = await _raw_upgrade(gw.port or 0, fenced_headers("ext/f", 1))
    try:
        writer.write(_frame(0x1, b"fragm", fin=False))
        writer.write(_frame(0x9, b"mid"))  # a control frame between the fragments
        writer.write(_frame(0x0, "ented ✓".encode(), fin=False))
        writer.write(_frame(0x0, b"!", fin=True))
        await writer.drain()
        first, second = await _read_frame(reader), await _read_frame(reader)
        assert {first, second} == {(0xA, b"mid"), (0x1, "fragmented ✓!".encode())}
    finally:
        writer.close()
    (conn,) = ws_upstream.connections
    assert [(m.kind, m.data) for m in conn.messages] == [
        ("ping", b"mid"),
        ("text", "fragmented ✓!".encode()),
    ]


async def test_refused_upgrades_reach_no_tool(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    """Steps 1 to 4 run on the upgrade's headers; a refusal is problem+json, leaves a
    `rejected` session receipt once resource and fence are readable, and the tool sees
    nothing, not even a connection."""
    policy = ws_policy(ws_upstream.url)
    policy["upstreams"].append({"name": "plain", "url": ws_upstream.url, "mount": "/plain"})
    policy["resources"].append({"match": "plain/*", "upstream": "plain"})
    gw = await gateway_factory(policy)
    first = await connect(session, gw, "ext/s", 7)  # accepted fence of ext/s is now 7
    await first.close()
    await ws_upstream.wait_connections(1)
    upgrade = {
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(),
        "Sec-WebSocket-Version": "13",
    }
    cases = {
        "stale": ("/tool/ws", {**upgrade, **fenced_headers("ext/s", 6)}),
        "no fence": ("/tool/ws", {**upgrade, "X-Lease-Resource": "ext/s"}),
        "no resource": ("/tool/ws", {**upgrade, "X-Fence-Token": "9"}),
        "no rule": ("/tool/ws", {**upgrade, **fenced_headers("other/s", 9)}),
        "bad fence": ("/tool/ws", {**upgrade, **fenced_headers("ext/s", "09")}),
        "not issued": ("/tool/ws", {**upgrade, **fenced_headers("gw/s", 1)}),
        "no key": ("/tool/ws", {**fenced_headers("ext/s", 9), **upgrade, "Sec-WebSocket-Key": ""}),
        "plain upstream": ("/plain/ws", {**upgrade, **fenced_headers("plain/s", 9)}),
        "no route": ("/nowhere/ws", {**upgrade, **fenced_headers("ext/s", 9)}),
        "not websocket": ("/tool/ws", {**fenced_headers("ext/s", 9), "Upgrade": "h2c",
                                       "Connection": "Upgrade"}),
    }  # fmt: skip
    results = {}
    for name, (path, headers) in cases.items():
        result = await call(session, "GET", f"{gw.url}{path}", headers=headers)
        results[name] = (result.status, problem(result)["code"])
    assert results == {
        "stale": (409, "stale_fence"),
        "no fence": (428, "missing_fence"),
        "no resource": (428, "missing_resource"),
        "no rule": (403, "resource_not_allowed"),
        "bad fence": (400, "invalid_fence"),
        "not issued": (403, "fence_not_issued"),
        "no key": (400, "invalid_request"),
        "plain upstream": (501, "upgrade_not_supported"),
        "no route": (501, "upgrade_not_supported"),
        "not websocket": (501, "upgrade_not_supported"),
    }
    await asyncio.sleep(0.1)
    assert len(ws_upstream.connections) == 1 and ws_upstream.requests == []
    rejected = await fetch_receipts(session, gw.url, status="rejected")
    assert sorted((r["kind"], r["reject_code"], r["method"]) for r in rejected) == [
        ("session", "fence_not_issued", "GET"),
        ("session", "resource_not_allowed", "GET"),
        ("session", "stale_fence", "GET"),
    ]


async def test_the_tool_refusing_the_upgrade_and_a_tool_that_cannot_be_reached(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    ws_upstream.refuse = Refusal(status=403, body=b'{"error": "no such target"}')
    policy = ws_policy(ws_upstream.url)
    nowhere = make_policy(f"http://127.0.0.1:{free_port()}", [{"match": "gone/*"}],
                          name="gone", mount="/gone", websocket=True)  # fmt: skip
    policy["upstreams"] += nowhere["upstreams"]
    policy["resources"] += nowhere["resources"]
    gw = await gateway_factory(policy)
    try:
        await connect(session, gw, "ext/r", 1)
        raise AssertionError("the upgrade was not refused")
    except aiohttp.WSServerHandshakeError as refused:
        assert refused.status == 403 and refused.headers["X-Tool"] == "refused"
        receipt_id = refused.headers["X-Receipt-Id"]
    answer = await call(
        session,
        "GET",
        f"{gw.url}/tool/ws",
        headers={**fenced_headers("ext/r", 1), "Upgrade": "websocket", "Connection": "Upgrade",
                 "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version": "13"},
    )  # fmt: skip
    assert (answer.status, answer.body) == (403, b'{"error": "no such target"}')
    assert answer.headers is not None and answer.headers["Content-Type"] == "application/json"
    receipt = await _receipt(session, gw.url, receipt_id)
    assert (receipt["status"], receipt["http_status"], receipt["session"]) == ("failed", 403, None)

    try:
        await connect(session, gw, "gone/1", 1, path="/gone/ws")
        raise AssertionError("an unreachable tool was not reported")
    except aiohttp.WSServerHandshakeError as unreachable:
        assert unreachable.status == 502
        receipt = await _receipt(session, gw.url, unreachable.headers["X-Receipt-Id"])
    assert (receipt["status"], receipt["error"], receipt["kind"]) == (
        "not_sent",
        "upstream_unreachable",
        "session",
    )


async def test_sessions_are_measured(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    gw = await gateway_factory(ws_policy(ws_upstream.url))
    ws = await connect(session, gw, "ext/m", 1)
    await ws.send_str("hi")
    await next_message(ws)
    metrics = await _metrics(session, gw.url)
    assert 'fence_gateway_sessions_open{upstream="tool"} 1.0' in metrics
    await ws.close()
    deadline = time.monotonic() + 5
    while 'fence_gateway_sessions_total{closed_by="client",upstream="tool"} 1.0' not in metrics:
        assert time.monotonic() < deadline, metrics
        await asyncio.sleep(0.05)
        metrics = await _metrics(session, gw.url)
    assert 'fence_gateway_sessions_open{upstream="tool"} 0.0' in metrics
    # one log line for the session's end, with what ended it and its counts
    await asyncio.sleep(0.1)
    line = next(x for x in gw.stderr_text().splitlines() if " session " in x)
    for field in ("closed_by=client", "close_code=1000", "messages_in=1", "status=101"):
        assert field in line, line


# -- helpers ----------------------------------------------------------------------------------


async def _receipt(session: aiohttp.ClientSession, url: str, receipt_id: str) -> dict[str, Any]:
    async with session.get(f"{url}/_gateway/v1/receipts/{receipt_id}") as answer:
        assert answer.status == 200
        body: dict[str, Any] = await answer.json()
        return body


async def _settled(session: aiohttp.ClientSession, url: str, receipt_id: str) -> dict[str, Any]:
    """The receipt once it is no longer `pending` (the session's end is recorded)."""
    deadline = time.monotonic() + 5
    while True:
        receipt = await _receipt(session, url, receipt_id)
        if receipt["status"] != "pending" or time.monotonic() > deadline:
            return receipt
        await asyncio.sleep(0.02)


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/_gateway/metrics") as answer:
        return await answer.text()


async def _raw_upgrade(
    port: int, headers: dict[str, str]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [
        "GET /tool/ws HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}",
        "Sec-WebSocket-Version: 13",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


def _frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    """A client frame (masked, RFC 6455 §5.2)."""
    mask = os.urandom(4)
    size = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    if size < 126:
        head += bytes([0x80 | size])
    elif size < 65536:
        head += bytes([0x80 | 126]) + size.to_bytes(2, "big")
    else:
        head += bytes([0x80 | 127]) + size.to_bytes(8, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One server frame (unmasked, unfragmented): (opcode, payload)."""
    first, second = await asyncio.wait_for(reader.readexactly(2), 5)
    size = second & 0x7F
    if size == 126:
        size = int.from_bytes(await reader.readexactly(2), "big")
    elif size == 127:
        size = int.from_bytes(await reader.readexactly(8), "big")
    return first & 0x0F, await reader.readexactly(size)
