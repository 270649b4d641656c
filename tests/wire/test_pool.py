"""The pool's rules: which connection a call goes on, when one is reused, and that nothing is
ever sent twice (docs/contract.md §2, "the gateway never retries by itself")."""

from __future__ import annotations

import asyncio
import socket

import pytest
from multidict import CIMultiDict

from gateway.wire.answer import HIGH_WATER
from gateway.wire.errors import ConnectError, NotSent, ReadError, ReadTimeout, Unencodable
from gateway.wire.pool import Pool
from tests.hostile.wire import WireTool
from tests.wire.conftest import pool_to
from tests.wire.test_framing import HEADERS, OK, fetch, read_all


async def test_a_connection_is_reused_after_a_whole_answer(scripted) -> None:
    tool: WireTool = await scripted({"/ok": OK})
    pool = pool_to(tool)
    try:
        for _ in range(3):
            assert (await fetch(pool, "/ok"))[2] == b"ok"
        assert tool.connections == [1, 1, 1]
    finally:
        await pool.close()


async def test_an_answer_released_unread_closes_its_connection(scripted) -> None:
    """A body not yet in whole when the caller is done with it: the rest would be read as
    the next call's answer, so the connection goes."""

    async def slow_body(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b"cd")

    tool = await scripted({"/slow": slow_body, "/ok": OK})
    pool = pool_to(tool)
    try:
        deadline = asyncio.get_running_loop().time() + 5
        async with await pool.send("GET", "/slow", HEADERS, None, deadline) as answer:
            assert answer.status == 200
        assert (await fetch(pool, "/ok"))[2] == b"ok"
        assert tool.connections == [1, 2]
    finally:
        await pool.close()


async def test_bytes_on_an_idle_connection_drop_it(scripted) -> None:
    """The tool writes after its whole answer, while the connection sits idle in the pool:
    the next call goes on a new connection and gets its own answer."""

    async def longer_later(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 7\r\n\r\nsmuggle")

    tool = await scripted({"/later": longer_later, "/ok": OK})
    pool = pool_to(tool)
    try:
        assert (await fetch(pool, "/later"))[2] == b"hello"
        await asyncio.sleep(0.3)
        assert await fetch(pool, "/ok") == (200, CIMultiDict({"Content-Length": "2"}), b"ok")
        assert tool.connections == [1, 2]
    finally:
        await pool.close()


async def test_an_idle_connection_the_tool_closed_is_not_used(scripted) -> None:
    """The tool closes a keep-alive connection while it is idle: the pool sees the close
    before the next write and sends that call, once, on a new connection."""

    async def then_close(writer: asyncio.StreamWriter) -> None:
        writer.write(OK)
        await writer.drain()
        writer.close()  # the tool's keep-alive timeout, at once

    tool = await scripted({"/once": then_close, "/ok": OK})
    pool = pool_to(tool)
    try:
        assert (await fetch(pool, "/once"))[2] == b"ok"
        await asyncio.sleep(0.1)
        assert (await fetch(pool, "/ok"))[2] == b"ok"
        assert [head.split(b" ")[1] for head in tool.heads] == [b"/once", b"/ok"]
        assert tool.connections == [1, 2]
    finally:
        await pool.close()


async def test_a_call_the_tool_read_and_dropped_is_never_sent_again(scripted) -> None:
    """After the write, a closed connection is `ReadError` (the tool may have acted): the
    call is not sent again, on this connection or another."""

    async def drop(writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    tool = await scripted({"/ok": OK, "/drop": drop})
    pool = pool_to(tool)
    try:
        await fetch(pool, "/ok")  # a pooled connection first, where a client might retry
        with pytest.raises(ReadError):
            await fetch(pool, "/drop", method="PUT")
        await asyncio.sleep(0.1)
        assert [head.split(b" ")[:2] for head in tool.heads] == [
            [b"GET", b"/ok"],
            [b"PUT", b"/drop"],
        ]
    finally:
        await pool.close()


async def test_no_answer_by_the_deadline_is_a_read_timeout(scripted) -> None:
    async def silent(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    tool = await scripted({"/silent": silent, "/ok": OK})
    pool = pool_to(tool)
    try:
        deadline = asyncio.get_running_loop().time() + 0.2
        with pytest.raises(ReadTimeout):
            await pool.send("POST", "/silent", HEADERS, b"{}", deadline)
        assert (await fetch(pool, "/ok"))[2] == b"ok"
        assert tool.connections == [1, 2]
    finally:
        await pool.close()


async def test_the_bound_holds_and_a_freed_connection_is_handed_on(scripted) -> None:
    gate = asyncio.Event()

    async def held(writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        writer.write(OK)

    tool = await scripted({"/held": held, "/ok": OK})
    pool = pool_to(tool, limit=1)
    try:
        first = asyncio.create_task(fetch(pool, "/held"))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(fetch(pool, "/ok"))
        await asyncio.sleep(0.1)
        assert tool.connections == [1]  # the second waits: one connection at most
        gate.set()
        assert [(await first)[2], (await second)[2]] == [b"ok", b"ok"]
        assert tool.connections == [1, 1]
    finally:
        await pool.close()


async def test_a_wait_for_a_free_connection_ends_with_the_connect_timeout(scripted) -> None:
    gate = asyncio.Event()

    async def held(writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        writer.write(OK)

    tool = await scripted({"/held": held, "/ok": OK})
    pool = pool_to(tool, limit=1, connect_timeout_s=0.2)
    try:
        first = asyncio.create_task(fetch(pool, "/held"))
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectError, match="busy"):
            await fetch(pool, "/ok")
        assert len(tool.heads) == 1  # the waiting call was never sent
        gate.set()
        await first
    finally:
        await pool.close()


async def test_a_refused_connection_is_not_sent() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = Pool("127.0.0.1", port, limit=1, connect_timeout_s=1)
    deadline = asyncio.get_running_loop().time() + 5
    with pytest.raises(ConnectError, match="ConnectionRefusedError") as refused:
        await pool.send("POST", "/x", HEADERS, b"{}", deadline)
    assert isinstance(refused.value, NotSent)
    await pool.close()


async def test_a_head_that_would_inject_headers_is_not_sent(scripted) -> None:
    tool = await scripted({"/ok": OK})
    pool = pool_to(tool)
    try:
        deadline = asyncio.get_running_loop().time() + 5
        injected = CIMultiDict(Host="tool", **{"X-Custom": "a\r\nX-Fence-Token: 99"})
        with pytest.raises(Unencodable):
            await pool.send("GET", "/ok", injected, None, deadline)
        assert tool.heads == []
    finally:
        await pool.close()


async def test_a_slow_reader_pauses_the_tool(scripted) -> None:
    """Body bytes not read stay under the high-water mark, give or take one read: the rest
    waits in the tool's socket until the reader takes what it has."""
    size = 8 * 1024 * 1024

    async def big(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()

    tool = await scripted({"/big": big})
    pool = pool_to(tool)
    try:
        deadline = asyncio.get_running_loop().time() + 30
        async with await pool.send("GET", "/big", HEADERS, None, deadline) as answer:
            await asyncio.sleep(0.3)  # the reader is slow
            assert answer._buffered <= HIGH_WATER + 256 * 1024
            assert len(await read_all(answer)) == size
    finally:
        await pool.close()


async def test_closing_the_pool_breaks_an_answer_that_runs_until_the_close(scripted) -> None:
    """At shutdown the pool aborts what is open: a close-delimited body cut there is broken,
    never taken for a whole answer (it could be kept for replay)."""

    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npart")
        await asyncio.sleep(5)

    tool = await scripted({"/endless": endless})
    pool = pool_to(tool)
    deadline = asyncio.get_running_loop().time() + 5
    answer = await pool.send("GET", "/endless", HEADERS, None, deadline)
    assert await answer.read() == b"part"
    await pool.close()
    with pytest.raises(ReadError):
        await answer.read()
    assert not answer.at_eof()


async def test_a_call_past_its_deadline_is_not_sent(scripted) -> None:
    """Even with an idle connection at hand, which needs no wait: nothing is written."""
    tool = await scripted({"/ok": OK})
    pool = pool_to(tool)
    try:
        await fetch(pool, "/ok")
        with pytest.raises(ConnectError, match="deadline"):
            await pool.send("POST", "/ok", HEADERS, b"{}", asyncio.get_running_loop().time())
        assert len(tool.heads) == 1
    finally:
        await pool.close()


async def test_a_call_waiting_when_the_pool_closes_is_not_sent(scripted) -> None:
    gate = asyncio.Event()

    async def held(writer: asyncio.StreamWriter) -> None:
        await gate.wait()

    tool = await scripted({"/held": held, "/ok": OK})
    pool = pool_to(tool, limit=1)
    first = asyncio.create_task(fetch(pool, "/held"))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(fetch(pool, "/ok"))
    await asyncio.sleep(0.05)
    await pool.close()
    with pytest.raises(ConnectError, match="closed"):
        await second
    with pytest.raises(ReadError):
        await first
    gate.set()
    assert len(tool.heads) == 1
