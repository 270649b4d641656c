"""How a tool's answer is relayed to its client: whole in one write when it is all in
(docs/design/performance.md), and its head at once when its body is slow to come.

Each write to the client's socket is a system call and a wake-up of the client; an answer's
head written apart from its body made two of each for every call. But a stream that stays
quiet for a while (SSE, an MCP GET stream) must not hold its status line back until its first
event. The real app runs in process (`make_app`) in front of a real upstream; the writes
counted are those of aiohttp's server-side writer, on the client's connection.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.http_writer import StreamWriter
from aiohttp.web_protocol import RequestHandler

from tests.harness import AppFactory, RecordingUpstream, make_policy

QUIET_S = 1.5  # how long the slow tool's stream stays quiet before its one event


@pytest.fixture
def server_writes(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[bytes]]:
    """What aiohttp's servers in this process wrote to their clients, by the server's port:
    one item per write to the transport."""
    writes: dict[int, list[bytes]] = {}
    write, writelines = StreamWriter._write, StreamWriter._writelines

    def note(writer: StreamWriter, data: bytes) -> None:
        protocol = writer._protocol
        if isinstance(protocol, RequestHandler) and protocol.transport is not None:
            port = protocol.transport.get_extra_info("sockname")[1]
            writes.setdefault(port, []).append(data)

    def counted_write(self: StreamWriter, chunk: Any) -> None:
        note(self, bytes(chunk))
        write(self, chunk)

    def counted_writelines(self: StreamWriter, chunks: Any) -> None:
        chunks = list(chunks)
        note(self, b"".join(chunks))
        writelines(self, chunks)

    monkeypatch.setattr(StreamWriter, "_write", counted_write)
    monkeypatch.setattr(StreamWriter, "_writelines", counted_writelines)
    return writes


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "plain"])
async def test_a_whole_answer_is_one_write(
    make_app: AppFactory,
    upstream: RecordingUpstream,
    server_writes: dict[int, list[bytes]],
    fenced: bool,
) -> None:
    gw = await make_app(make_policy(upstream.url, [{"match": "res/*"}]))
    headers = {"X-Lease-Resource": "res/a", "X-Fence-Token": "1"} if fenced else {}
    async with gw.client.request(
        "POST" if fenced else "GET", "/tool/act", data=b"{}" if fenced else None, headers=headers
    ) as response:
        body = await response.read()
    assert response.status == 200
    [written] = server_writes[gw.port]
    assert written.startswith(b"HTTP/1.1 200 ") and written.endswith(b"\r\n\r\n" + body)


@pytest.fixture
async def slow_stream() -> AsyncIterator[str]:
    """A tool that answers every request with an SSE head at once and its one event after
    QUIET_S: the JSON-RPC answer to a POSTed MCP call, an empty event to anything else."""

    async def handle(request: web.Request) -> web.StreamResponse:
        event = b"{}"
        if request.method == "POST":
            call = await request.json()
            event = json.dumps({"jsonrpc": "2.0", "id": call["id"], "result": {}}).encode()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(QUIET_S)
        await response.write(b"data: " + event + b"\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}/api"
    await runner.cleanup()


async def _seconds_to_head(gw: Any, method: str, **kwargs: Any) -> float:
    started = time.monotonic()
    async with gw.client.request(method, "/tool/mcp", **kwargs) as response:
        took = time.monotonic() - started
        assert response.status == 200, await response.text()
        assert b"data: " in await response.read()  # and the event after it
    return took


@pytest.mark.parametrize("mcp", [False, True], ids=["plain", "mcp"])
async def test_a_quiet_stream_has_its_head_at_once(
    make_app: AppFactory, slow_stream: str, mcp: bool
) -> None:
    """An unfenced GET stream: a plain tool's, and an MCP tool's stream of its messages."""
    gw = await make_app(
        make_policy(slow_stream, [{"match": "res/*", "tools": ["send_*"]}], mcp=True)
        if mcp
        else make_policy(slow_stream, [{"match": "res/*"}])
    )
    took = await _seconds_to_head(gw, "GET", headers={"Accept": "text/event-stream"})
    assert took < QUIET_S / 3


async def test_a_fenced_mcp_call_answered_in_sse_has_its_head_at_once(
    make_app: AppFactory, slow_stream: str
) -> None:
    gw = await make_app(
        make_policy(slow_stream, [{"match": "res/*", "tools": ["send_*"]}], mcp=True)
    )
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "send_x"}}
    took = await _seconds_to_head(
        gw,
        "POST",
        json=call,
        headers={
            "Accept": "application/json, text/event-stream",
            "X-Lease-Resource": "res/a",
            "X-Fence-Token": "1",
        },
    )
    assert took < QUIET_S / 3
