"""The front's flow control toward a client that does not read (gateway.wire.front): its
next request waits until the client reads the answers it was sent, refusals included, and a
connection closed during a shed call's pause serves nothing more."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

from gateway.server.http_server import GatewayServer
from gateway.wire.front import Front
from tests.e2e.served import served
from tests.harness import RecordingUpstream, make_policy
from tests.wire.test_front import Start, start  # `start` is a fixture

__all__ = ["start"]

WAIT = 10.0


async def eventually(check: Any, within: float = WAIT) -> None:
    async with asyncio.timeout(within):
        while not check():
            await asyncio.sleep(0.01)


def fronts(server: GatewayServer) -> list[tuple[Front, asyncio.Transport]]:
    return [(f, t) for f, t in server._connections.items() if isinstance(f, Front)]  # type: ignore[attr-defined]


async def test_refusals_pipelined_to_a_client_that_does_not_read_wait_for_it(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """Flow control of the front's own refusals: a client pipelines thousands of requests the
    call path refuses (400 invalid_request, a dot segment) and reads none of the answers.
    The next request waits while the client does not read (as aiohttp's server waits, its
    write_eof draining); the front wrote each refusal and went on to the next request, and
    the gateway's write buffer grew with every request the client sent (MBs here, without
    bound in general)."""
    async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}])) as gateway:
        port, server = gateway.port, gateway.server
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        _, writer = await asyncio.open_connection(sock=sock)
        await eventually(lambda: len(fronts(server)) == 1)
        _, transport = fronts(server)[0]
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        refused = b"GET /tool/../x HTTP/1.1\r\nHost: x\r\n\r\n"
        for _ in range(40):
            writer.write(refused * 100)  # 4,000 requests in all, never an answer read
            await writer.drain()
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        high_water = transport.get_write_buffer_limits()[1]
        buffered = transport.get_write_buffer_size()
        writer.transport.abort()
        assert buffered <= high_water + 4096, (
            f"{buffered} bytes of answers buffered for a client reading none "
            f"(the transport's high-water mark is {high_water})"
        )


async def test_a_connection_closed_in_its_shed_pause_serves_nothing_after(start: Start) -> None:
    """Shutdown (`close()`) during a shed call's Retry-After pause, on a connection whose
    last answers are not all written out yet (the client reads slowly, so the transport
    closes only once they are): the pause ends in nothing. The request pipelined behind the
    shed one is never dispatched on the closing connection: in the gateway it would be a
    proxied call started after the server closed its connections (an unfenced one forwarded
    to the tool), its answer never written."""
    served = await start()
    dispatch = served.dispatch
    dispatch.retry_after_s = 0.3
    answered = dispatch._answer

    async def answer(incoming: Any, path: str, body: bytes) -> None:
        if path != "/fill":
            return await answered(incoming, path, body)
        # an answer below the transport's high-water mark: its writes do not wait, and
        # what the kernel will not take yet stays in the transport's buffer
        reply = incoming.reply(200)
        reply.headers["Content-Length"] = str(48 * 1024)
        await reply.write(b"f" * 48 * 1024)
        await reply.write_eof()

    dispatch._answer = answer  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # reads nothing
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    await loop.sock_connect(client, ("127.0.0.1", served.port))
    try:
        front, transport = await served.front()
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        await loop.sock_sendall(client, b"GET /fill HTTP/1.1\r\nHost: t\r\n\r\n")
        await eventually(lambda: "end /fill" in dispatch.events)
        assert transport.get_write_buffer_size() > 0  # the client has not read it all
        dispatch.shed = 1
        await loop.sock_sendall(
            client,
            b"GET /shed HTTP/1.1\r\nHost: t\r\n\r\nGET /after HTTP/1.1\r\nHost: t\r\n\r\n",
        )
        await eventually(lambda: dispatch.shed == 0)  # shed: the pause begins
        front.close()  # the server shuts down: the connection is idle, so it closes
        await asyncio.sleep(0.6)  # the pause is over
        assert "start /after" not in dispatch.events, dispatch.events
    finally:
        client.close()
