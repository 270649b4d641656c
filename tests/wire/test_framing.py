"""Every shape of answer, as the wire reads it: where it ends, and whether its connection can
carry the next call (RFC 9112 §6.3; docs/contract.md §3, "Outcome")."""

from __future__ import annotations

import asyncio

import pytest
from multidict import CIMultiDict

from gateway.wire.answer import Answer
from gateway.wire.errors import MaybeSent, ProtocolError, ReadError
from gateway.wire.pool import Pool
from tests.hostile.wire import WireTool
from tests.wire.conftest import pool_to

HEADERS = CIMultiDict(Host="tool")


async def fetch(pool: Pool, path: str, method: str = "GET") -> tuple[int, CIMultiDict[str], bytes]:
    """One call, its body read whole, its connection released."""
    deadline = asyncio.get_running_loop().time() + 5
    async with await pool.send(method, path, HEADERS, None, deadline) as answer:
        return answer.status, answer.headers, await read_all(answer)


async def read_all(answer: Answer) -> bytes:
    chunks = []
    while chunk := await answer.read():
        chunks.append(chunk)
    assert answer.at_eof()
    return b"".join(chunks)


# path → the bytes the tool writes, the status and body the wire reads, and whether the
# connection carried the next call (`/ok`)
SHAPES = {
    "/length": (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", 200, b"hello", True),
    "/chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n",
        200,
        b"hello world",
        True,
    ),
    "/no-content": (b"HTTP/1.1 204 No Content\r\n\r\n", 204, b"", True),
    # a 304 keeps the Content-Length of the body it does not send
    "/not-modified": (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n", 304, b"", True),
    "/interim": (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
        201,
        b"ok",
        True,
    ),
    "/told-to-close": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
        200,
        b"ok",
        False,
    ),
    "/http-1.0": (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", 200, b"ok", False),
    # a body longer than its Content-Length: the rest is nobody's answer
    "/longer": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n"
        b"Content-Length: 7\r\n\r\nsmuggle",
        200,
        b"ok",
        False,
    ),
}
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.mark.parametrize("path", sorted(SHAPES))
async def test_each_shape_ends_where_its_framing_says(scripted, path: str) -> None:
    written, status, body, reused = SHAPES[path]
    tool: WireTool = await scripted({path: written, "/ok": OK})
    pool = pool_to(tool)
    try:
        got = await fetch(pool, path)
        assert (got[0], got[2]) == (status, body)
        assert await fetch(pool, "/ok") == (200, CIMultiDict({"Content-Length": "2"}), b"ok")
        assert tool.connections == ([1, 1] if reused else [1, 2])
    finally:
        await pool.close()


async def test_only_the_final_answer_s_headers_are_read(scripted) -> None:
    tool = await scripted({"/interim": SHAPES["/interim"][0]})
    pool = pool_to(tool)
    try:
        _, headers, _ = await fetch(pool, "/interim")
        assert list(headers.items()) == [("Content-Length", "2")]  # no Link of the 103
    finally:
        await pool.close()


async def test_an_answer_to_head_ends_with_its_head(scripted) -> None:
    """The parser cannot know the request was HEAD: the answer ends at its head, whatever
    its Content-Length, and the connection carries the next call."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nX-Doc: 1\r\n\r\n"
    tool = await scripted({"/doc": head, "/ok": OK})
    pool = pool_to(tool)
    try:
        status, headers, body = await fetch(pool, "/doc", method="HEAD")
        assert (status, headers["Content-Length"], body) == (200, "10", b"")
        assert (await fetch(pool, "/ok"))[2] == b"ok"
        assert tool.connections == [1, 1]
    finally:
        await pool.close()


async def test_a_close_delimited_body_ends_with_the_connection(scripted) -> None:
    async def until_close(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nall of ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"it")
        writer.close()

    tool = await scripted({"/stream": until_close, "/ok": OK})
    pool = pool_to(tool)
    try:
        assert (await fetch(pool, "/stream"))[2] == b"all of it"
        assert (await fetch(pool, "/ok"))[2] == b"ok"
        assert tool.connections == [1, 2]
    finally:
        await pool.close()


async def test_a_short_body_breaks_after_what_arrived(scripted) -> None:
    """Fewer bytes than the Content-Length, then the connection closes: what came is read,
    then `ReadError` (the call was sent: its outcome is unknown)."""

    async def short(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        writer.close()

    tool = await scripted({"/short": short})
    pool = pool_to(tool)
    try:
        deadline = asyncio.get_running_loop().time() + 5
        async with await pool.send("GET", "/short", HEADERS, None, deadline) as answer:
            assert await answer.read() == b"abc"
            with pytest.raises(ReadError) as broken:
                await answer.read()
            assert isinstance(broken.value, MaybeSent)
            assert not answer.at_eof()
    finally:
        await pool.close()


@pytest.mark.parametrize(
    "written",
    [
        b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
        b"lorem ipsum\r\n\r\n",
        b"HTTP/1.1 099 Early\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Folded: a\r\n b\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",
        b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: v\r\n" % n for n in range(200)) + b"\r\n",
    ],
    ids=[
        "bad-status",
        "no-status-line",
        "status-below-100",
        "unasked-101",
        "two-lengths",
        "length-and-chunked",
        "folded-header",
        "bare-lf",
        "too-many-headers",
    ],
)
async def test_what_is_no_http_answer_is_a_protocol_error(scripted, written: bytes) -> None:
    tool = await scripted({"/bad": written, "/ok": OK})
    pool = pool_to(tool)
    try:
        with pytest.raises(ProtocolError) as failed:
            await fetch(pool, "/bad")
        assert isinstance(failed.value, MaybeSent)
        assert (await fetch(pool, "/ok"))[2] == b"ok"
        assert tool.connections == [1, 2]  # the broken connection carried nothing more
    finally:
        await pool.close()


async def test_an_endless_head_is_cut_off(scripted) -> None:
    """One header line that never ends: refused once the head is over its limit, before it
    fills the memory, and not at the deadline."""

    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
        for _ in range(1000):
            writer.write(b"v" * 1024)
            await writer.drain()

    tool = await scripted({"/endless": endless})
    pool = pool_to(tool)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(ProtocolError, match="head is over"):
            await fetch(pool, "/endless")
        assert asyncio.get_running_loop().time() - started < 4
    finally:
        await pool.close()


async def test_a_read_waits_for_the_body_until_its_deadline_and_no_longer(scripted) -> None:
    """A body that stops coming: what came is read at once, even past the deadline (nothing to
    wait for); the next read ends in TimeoutError at the deadline, no waiter left behind;
    and the connection is not used again."""
    stalled = asyncio.Event()

    async def stalls(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        await stalled.wait()

    tool = await scripted({"/stalls": stalls, "/ok": SHAPES["/length"][0]})
    pool = pool_to(tool)
    loop = asyncio.get_running_loop()
    try:
        async with await pool.send("GET", "/stalls", HEADERS, None, loop.time() + 5) as answer:
            while not answer._chunks:  # the first bytes of the body, in
                await asyncio.sleep(0.01)
            assert await answer.read(-1, loop.time() - 1) == b"abc"
            started = loop.time()
            with pytest.raises(TimeoutError):
                await answer.read(-1, started + 0.3)
            assert 0.25 < loop.time() - started < 2
            assert answer._waiter is None and not answer.ended
        assert (await fetch(pool, "/ok"))[2] == b"hello"
        assert tool.connections == [1, 2]  # the stalled one carried nothing more
    finally:
        stalled.set()
        await pool.close()
