"""The last check before a call's bytes leave (docs/contract.md §14, "A replica fences
itself"): asked once a connection to the tool is in hand, new or reused, in the same step as
the write; when it says no, nothing reaches the tool, the call is `not_sent`, and the
connection is closed."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from multidict import CIMultiDict

from gateway.config.policy import Upstream
from gateway.proxy.upstream import UpstreamFailure, Upstreams
from tests.harness import RecordingUpstream


@pytest.mark.parametrize("connection", ["new", "reused"])
async def test_a_withdrawn_call_never_reaches_the_tool(
    upstream: RecordingUpstream, connection: str
) -> None:
    tool = Upstream(name="tool", url=upstream.url, mount="/tool")
    upstreams = Upstreams({"tool": tool})
    await upstreams.open()
    try:
        deadline = asyncio.get_running_loop().time() + 5
        if connection == "reused":  # one call first leaves a keep-alive connection behind
            async with await upstreams.send(tool, "GET", "/warm", headers(tool), None, deadline):
                pass
        asked = []

        def may_send() -> bool:
            asked.append(True)
            return False

        with pytest.raises(UpstreamFailure) as failure:
            await upstreams.send(
                tool, "POST", "/act", headers(tool), b"{}", deadline, may_send=may_send
            )
        assert failure.value.as_outcome(0.0).status == "not_sent"
        assert failure.value.as_outcome(0.0).error == "instance_lapsed"
        assert failure.value.error.code == "store_unavailable"
        assert asked == [True]
        await asyncio.sleep(0.1)
        assert [r.path for r in upstream.requests] == (
            ["/api/warm"] if connection == "reused" else []
        )
        # the connection it was asked on (the warm one, when reused) is neither pooled nor
        # left open
        assert upstream.port is not None and open_connections_to(upstream.port) == 0
    finally:
        await upstreams.close()


def open_connections_to(port: int) -> int:
    """Established TCP connections to 127.0.0.1:`port` from this host (Linux's table)."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    remote = f"0100007F:{port:04X}"
    return sum(1 for row in rows if row.split()[2] == remote and row.split()[3] == "01")


async def test_the_check_and_the_write_are_one_step() -> None:
    """Nothing runs between the check and the write: no turn of the event loop, no task of
    the client's own writing later. A callback the check schedules finds the whole request
    already in the tool's socket, so what the check answered held when the bytes left."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    tool = Upstream(name="tool", url=f"http://127.0.0.1:{port}/api", mount="/tool")
    upstreams = Upstreams({"tool": tool})
    await upstreams.open()
    loop = asyncio.get_running_loop()
    seen: list[bytes] = []
    peers: list[socket.socket] = []

    def right_after_the_check() -> None:
        peer, _ = listener.accept()  # connected already: it waits in the backlog
        peers.append(peer)
        peer.setblocking(False)
        try:
            seen.append(peer.recv(65536, socket.MSG_PEEK))
        except BlockingIOError:
            seen.append(b"")
        peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    def may_send() -> bool:
        loop.call_soon(right_after_the_check)
        return True

    try:
        deadline = loop.time() + 5
        body = b"x" * 100_000  # bigger than one segment: head and body are one write still
        async with await upstreams.send(
            tool, "POST", "/act", headers(tool), body, deadline, may_send=may_send
        ) as answer:
            assert answer.status == 200
        assert len(seen) == 1
        assert seen[0].startswith(b"POST /api/act HTTP/1.1\r\nHost: 127.0.0.1:")
    finally:
        await upstreams.close()
        for peer in peers:
            peer.close()
        listener.close()


def headers(tool: Upstream) -> CIMultiDict[str]:
    """What every call carries first (`relay.upstream_headers`)."""
    return CIMultiDict(Host=tool.authority)


async def test_a_session_s_handshake_is_asked_too(upstream: RecordingUpstream) -> None:
    """A session's upgrade (docs/contract.md §15) goes through the same last check: a lapsed
    process writes no handshake, and the session is `not_sent`."""
    tool = Upstream(name="tool", url=upstream.url, mount="/tool", websocket=True)
    upstreams = Upstreams({"tool": tool})
    await upstreams.open()
    try:
        deadline = asyncio.get_running_loop().time() + 5
        asked = []

        def may_send() -> bool:
            asked.append(True)
            return False

        with pytest.raises(UpstreamFailure) as failure:
            await upstreams.open_websocket(
                tool, "/ws", CIMultiDict(), (), deadline, may_send=may_send
            )
        assert failure.value.as_outcome(0.0).status == "not_sent"
        assert failure.value.as_outcome(0.0).error == "instance_lapsed"
        assert asked == [True]
        await asyncio.sleep(0.1)
        assert upstream.requests == []
        assert upstream.port is not None and open_connections_to(upstream.port) == 0
    finally:
        await upstreams.close()
