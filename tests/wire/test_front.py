"""The front (gateway.wire.front) on a real socket: what it serves itself, what it lends to
aiohttp one request at a time, what it hands to aiohttp for good from a request's first
byte, and what it owns for the requests it serves (one at a time, the header and keep-alive
timers, the shed pause, flow control, `Connection: close` and the drain at shutdown;
docs/contract.md §5).

A fake dispatch stands in for the server layer: it serves every target but `/aiohttp...`,
answers by path, and gives a recording protocol in place of aiohttp's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from email.utils import parsedate_to_datetime
from typing import NamedTuple, Protocol

import pytest
from aiohttp.http import SERVER_SOFTWARE
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.wire.backlog import Backlog
from gateway.wire.front import Front
from gateway.wire.incoming import Incoming

WAIT = 10.0  # the bound on anything that should happen soon (a loaded 2-core machine)
SHED = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n"
CANNED = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\naiohttp"  # the recorder's answer
BIG = 4 * 1024 * 1024  # the body of `/big`'s answer
GET = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"


@dataclasses.dataclass
class Seen:
    method: str
    raw_path: str
    headers: CIMultiDictProxy[str]
    body: bytes


class Recorder(asyncio.Protocol):
    """aiohttp's protocol as these tests need it: every byte it is given, and a canned
    answer to its first request. Lent one request (`returned`), it gives the connection
    back once it has that request whole and has answered it (after `hold`, when set)."""

    def __init__(
        self, answer: bytes, returned: Callable[[], None] | None, hold: asyncio.Event | None
    ) -> None:
        self.transport: asyncio.Transport | None = None
        self.data = bytearray()
        self.answer: bytes | None = answer
        self.returned = returned
        self.hold = hold
        self.lost = False
        self._grew = asyncio.Event()
        self.answering: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data
        self._grew.set()
        if self.answer is None or self.transport is None:
            return
        if self.returned is None:  # handed over: answered at its first bytes
            self._answer()
        elif self._whole() and self.answering is None:
            self.answering = asyncio.get_running_loop().create_task(self._answer_lent())

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        self._grew.set()

    async def received(self, size: int) -> bytes:
        """All it was given, once that is at least `size` bytes."""
        async with asyncio.timeout(WAIT):
            while len(self.data) < size:
                self._grew.clear()
                await self._grew.wait()
        return bytes(self.data)

    def _whole(self) -> bool:
        end = self.data.find(b"\r\n\r\n")
        if end < 0:
            return False
        found = re.search(rb"\r\ncontent-length: *([0-9]+)", self.data[:end].lower())
        return len(self.data) >= end + 4 + (int(found[1]) if found else 0)

    def _answer(self) -> None:
        assert self.transport is not None and self.answer is not None
        self.transport.write(self.answer)
        self.answer = None

    async def _answer_lent(self) -> None:
        if self.hold is not None:
            await self.hold.wait()
        self._answer()
        assert self.returned is not None
        self.returned()


class FakeDispatch:
    """The server layer: serves all but `/aiohttp...`, answers by path, records it all."""

    app = None
    retry_after_s = 1.0

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.events: list[str] = []  # "start /path" and "end /path", in order
        self.broken: list[tuple[bytes, BaseException]] = []  # body read so far, the error
        self.tasks: list[asyncio.Task[None]] = []
        self.recorders: list[Recorder] = []
        self.shed = 0  # how many of the next requests are overloaded, and shed by admit
        self.admitted: list[tuple[str, bool]] = []  # (path, waited) of every admit
        self.gate = asyncio.Event()  # what `/wait` waits for before answering
        self.hold_lent: asyncio.Event | None = None  # what a lent request's answer waits for
        self._loop = asyncio.get_running_loop()

    def serves(self, incoming: Incoming) -> bool:
        return not incoming.raw_path.startswith("/aiohttp")

    def overloaded(self, incoming: Incoming, *, waited: bool = False) -> bool:
        return self.shed > 0  # as the server's limit: overloaded when admit would shed

    def admit(self, incoming: Incoming, *, waited: bool = False) -> bytes | None:
        self.admitted.append((incoming.raw_path, waited))
        if self.shed:
            self.shed -= 1
            return SHED
        return None

    def call(self, incoming: Incoming) -> asyncio.Task[None]:
        task = self._loop.create_task(self._serve(incoming))
        self.tasks.append(task)
        return task

    def aiohttp_protocol(self, returned: Callable[[], None] | None = None) -> asyncio.Protocol:
        recorder = Recorder(CANNED, returned, self.hold_lent)
        self.recorders.append(recorder)
        return recorder

    async def _serve(self, incoming: Incoming) -> None:
        path = incoming.raw_path.partition("?")[0]
        self.events.append(f"start {path}")
        try:
            body = b"" if path == "/unread" else await self._read(incoming)
            self.seen.append(Seen(incoming.method, incoming.raw_path, incoming.headers, body))
            if path == "/slow":
                await asyncio.sleep(0.3)
            elif path == "/wait":
                await self.gate.wait()
            await self._answer(incoming, path, body)
        except ConnectionResetError:
            pass  # recorded in `broken` when it was the body's
        finally:
            self.events.append(f"end {path}")

    async def _read(self, incoming: Incoming) -> bytes:
        chunks: list[bytes] = []
        try:
            async for chunk in incoming.content.iter_any():
                chunks.append(chunk)
        except ConnectionResetError as exc:
            self.broken.append((b"".join(chunks), exc))
            raise
        return b"".join(chunks)

    async def _answer(self, incoming: Incoming, path: str, body: bytes) -> None:
        if path == "/chunked":  # no Content-Length: chunked
            reply = incoming.reply(200)
            await reply.write(b"hello")
            await reply.write(b" world")
        elif path == "/no-content":
            reply = incoming.reply(204)
            reply.headers["Content-Length"] = "10"  # of no body: not sent (RFC 9110 §8.6)
            await reply.write(b"never sent")
        elif path == "/big":
            reply = incoming.reply(200)
            reply.headers["Content-Length"] = str(BIG)
            piece = b"x" * 65536
            for _ in range(BIG // len(piece)):
                await reply.write(piece)
        else:
            text = f"{incoming.method} {incoming.raw_path} {len(body)}".encode()
            reply = incoming.reply(200)
            reply.headers["Content-Length"] = str(len(text))
            await reply.write(text)
        await reply.write_eof()


class Served:
    """A front server on 127.0.0.1: its dispatch, and the connections it (un)registered."""

    def __init__(self, dispatch: FakeDispatch, server: asyncio.Server) -> None:
        self.dispatch = dispatch
        self.server = server
        self.port: int = server.sockets[0].getsockname()[1]
        self.registered: list[tuple[Front, asyncio.Transport | None]] = []
        self.writers: list[asyncio.StreamWriter] = []

    def register(self, front: Front, transport: asyncio.Transport | None) -> None:
        self.registered.append((front, transport))

    async def connect(
        self, *, rcvbuf: int | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        self.writers.append(writer)
        return reader, writer

    async def front(self, index: int = 0) -> tuple[Front, asyncio.Transport]:
        """The `index`th connection's front and transport, once it is registered."""
        await eventually(lambda: len(self.on) > index)
        return self.on[index]

    @property
    def on(self) -> list[tuple[Front, asyncio.Transport]]:
        return [(front, transport) for front, transport in self.registered if transport]

    @property
    def off(self) -> list[Front]:
        return [front for front, transport in self.registered if transport is None]

    async def recorder(self, index: int = 0) -> Recorder:
        """The `index`th aiohttp protocol the front made (to hand over to, or to lend)."""
        await eventually(lambda: len(self.dispatch.recorders) > index)
        return self.dispatch.recorders[index]

    async def lent_and_held(self) -> Lent:
        """The first connection, `NOT_SERVED` lent on it and received by aiohttp's stand-in,
        whose answer waits for `hold`."""
        self.dispatch.hold_lent = hold = asyncio.Event()
        reader, writer = await self.connect()
        front, transport = await self.front()
        writer.write(NOT_SERVED)
        recorder = await self.recorder()
        await recorder.received(len(NOT_SERVED))
        return Lent(reader, writer, front, transport, recorder, hold)


class Lent(NamedTuple):
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    front: Front
    transport: asyncio.Transport
    recorder: Recorder
    hold: asyncio.Event


class Start(Protocol):
    async def __call__(
        self,
        *,
        header_timeout_s: float = ...,
        keepalive_timeout_s: float = ...,
        full: Callable[[], bool] | None = ...,
    ) -> Served: ...


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """`served = await start(header_timeout_s=..., keepalive_timeout_s=..., full=...)`,
    closed at teardown with every connection and call; with `full`, the fronts share a
    backlog that holds heads while `full()` says so."""
    started: list[Served] = []

    async def begin(
        *,
        header_timeout_s: float = 30.0,
        keepalive_timeout_s: float = 30.0,
        full: Callable[[], bool] | None = None,
    ) -> Served:
        dispatch = FakeDispatch()
        holder: list[Served] = []
        backlog = Backlog(full) if full is not None else None

        def factory() -> Front:
            return Front(
                dispatch,
                holder[0].register,
                header_timeout_s=header_timeout_s,
                keepalive_timeout_s=keepalive_timeout_s,
                backlog=backlog,
            )

        server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
        served = Served(dispatch, server)
        holder.append(served)
        started.append(served)
        return served

    yield begin
    for served in started:
        for writer in served.writers:
            writer.transport.abort()
        for _, transport in served.on:
            transport.abort()
        served.server.close()
        await served.server.wait_closed()
        tasks = served.dispatch.tasks + [
            recorder.answering for recorder in served.dispatch.recorders if recorder.answering
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Answer(NamedTuple):
    status: int
    headers: CIMultiDict[str]
    body: bytes


async def eventually(check: Callable[[], bool], within: float = WAIT) -> None:
    async with asyncio.timeout(within):
        while not check():
            await asyncio.sleep(0.01)


async def read_head(reader: asyncio.StreamReader) -> tuple[int, CIMultiDict[str]]:
    async with asyncio.timeout(WAIT):
        head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, _, value = line.partition(": ")
        headers.add(name, value)
    return int(status_line.split(" ")[1]), headers


async def read_answer(reader: asyncio.StreamReader, *, to_head: bool = False) -> Answer:
    """One answer, its body read by its framing (none to HEAD, 1xx, 204 and 304)."""
    status, headers = await read_head(reader)
    async with asyncio.timeout(WAIT):
        if to_head or status < 200 or status in (204, 304):
            body = b""
        elif "Content-Length" in headers:
            body = await reader.readexactly(int(headers["Content-Length"]))
        elif headers.get("Transfer-Encoding") == "chunked":
            chunks = []
            while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
                chunks.append(await reader.readexactly(size))
                assert await reader.readexactly(2) == b"\r\n"
            assert await reader.readexactly(2) == b"\r\n"
            body = b"".join(chunks)
        else:
            body = await reader.read()
    return Answer(status, headers, body)


async def at_eof(reader: asyncio.StreamReader, within: float = WAIT) -> bytes:
    """What the front still sent before it closed the connection (b"" when nothing)."""
    async with asyncio.timeout(within):
        try:
            return await reader.read()
        except ConnectionResetError:
            return b""


async def still_open(reader: asyncio.StreamReader, for_s: float) -> None:
    """Nothing comes, and the connection is not closed, for `for_s` seconds."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), for_s)


def now() -> float:
    return time.monotonic()


class TestServed:
    """Requests the front frames itself are answered as aiohttp would answer them."""

    async def test_a_get_is_answered_with_date_server_and_its_length(self, start: Start) -> None:
        """A GET reaches the call, and its answer has Date, Server and Content-Length."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(b"GET /x?q=1 HTTP/1.1\r\nHost: t\r\nX-Thing: a b\r\n\r\n")
        answer = await read_answer(reader)
        assert answer.status == 200
        assert answer.body == b"GET /x?q=1 0"
        assert answer.headers["Content-Length"] == str(len(answer.body))
        assert answer.headers["Server"] == SERVER_SOFTWARE
        assert parsedate_to_datetime(answer.headers["Date"]).tzname() == "UTC"
        assert "Transfer-Encoding" not in answer.headers
        assert "Connection" not in answer.headers  # kept alive
        [seen] = served.dispatch.seen
        assert (seen.method, seen.raw_path, seen.body) == ("GET", "/x?q=1", b"")
        assert seen.headers["X-Thing"] == "a b"
        assert seen.headers["host"] == "t"

    async def test_a_post_body_framed_by_content_length_reaches_the_call(
        self, start: Start
    ) -> None:
        """The body of a POST, framed by its Content-Length, is what the call reads."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 11\r\n\r\nhello world")
        assert (await read_answer(reader)).body == b"POST /x 11"
        assert served.dispatch.seen[0].body == b"hello world"

    async def test_utf8_values_before_the_length_are_the_fronts(self, start: Start) -> None:
        """A head with UTF-8 in its values (two bytes a character) is framed by the front,
        every value and the body's length read right."""
        served = await start()
        reader, writer = await served.connect()
        head = "POST /x HTTP/1.1\r\nHost: t\r\nX-Name: café olé\r\nContent-Length: 2\r\n\r\n"
        writer.write(head.encode() + b"hi")
        assert (await read_answer(reader)).body == b"POST /x 2"
        [seen] = served.dispatch.seen
        assert list(seen.headers.items()) == [
            ("Host", "t"),
            ("X-Name", "café olé"),
            ("Content-Length", "2"),
        ]
        assert seen.body == b"hi"

    async def test_an_answer_without_length_is_chunked(self, start: Start) -> None:
        """An answer without Content-Length goes out chunked, one chunk per write, then the
        last chunk, and the connection carries the next request."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(b"GET /chunked HTTP/1.1\r\nHost: t\r\n\r\n")
        status, headers = await read_head(reader)
        assert status == 200
        assert headers["Transfer-Encoding"] == "chunked"
        assert "Content-Length" not in headers
        framed = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(framed)) == framed
        writer.write(GET)
        assert (await read_answer(reader)).body == b"GET /x 0"

    async def test_an_answer_to_head_has_no_body(self, start: Start) -> None:
        """HEAD gets the head only (its Content-Length kept): the next answer follows it
        directly."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(
            b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\nHEAD /chunked HTTP/1.1\r\nHost: t\r\n\r\n"
        )
        head = await read_answer(reader, to_head=True)
        assert head.status == 200
        assert head.headers["Content-Length"] == str(len(b"HEAD /x 0"))
        chunked = await read_answer(reader, to_head=True)
        assert chunked.status == 200
        assert "Transfer-Encoding" not in chunked.headers
        writer.write(GET)
        assert (await read_answer(reader)).body == b"GET /x 0"

    async def test_a_204_has_no_body(self, start: Start) -> None:
        """A 204's writes send nothing, nor chunked framing: the next answer follows it."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(b"GET /no-content HTTP/1.1\r\nHost: t\r\n\r\n" + GET)
        status, headers = await read_head(reader)
        assert status == 204
        assert "Transfer-Encoding" not in headers
        assert "Content-Length" not in headers
        assert (await read_answer(reader)).body == b"GET /x 0"

    async def test_a_head_and_body_in_pieces_arrive_whole(self, start: Start) -> None:
        """A head split across writes, then a body in several pieces with pauses between,
        reaches the call whole."""
        served = await start()
        reader, writer = await served.connect()
        pieces = [bytes([65 + i]) * 10_000 for i in range(3)]
        writer.write(b"POST /x HT")
        await asyncio.sleep(0.05)
        writer.write(b"TP/1.1\r\nHost: t\r\nContent-Length: 30000\r\n\r\n")
        for piece in pieces:
            await asyncio.sleep(0.05)
            writer.write(piece)
        assert (await read_answer(reader)).body == b"POST /x 30000"
        assert served.dispatch.seen[0].body == b"".join(pieces)


class TestPipelining:
    """Pipelined requests are served one at a time, in order."""

    async def test_two_requests_in_one_write_are_answered_in_order(self, start: Start) -> None:
        """The second request's call starts only once the first's answer is written."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(
            b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello"
            b"GET /second HTTP/1.1\r\nHost: t\r\n\r\n"
        )
        assert (await read_answer(reader)).body == b"POST /slow 5"
        assert (await read_answer(reader)).body == b"GET /second 0"
        assert served.dispatch.events == [
            "start /slow",
            "end /slow",
            "start /second",
            "end /second",
        ]


HANDED_OVER = {
    "chunked-body": (
        b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    ),
    "http-1.0": b"GET /x HTTP/1.0\r\nHost: t\r\n\r\n",
    "expect-100-continue": (
        b"POST /x HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    ),
    "upgrade-header": b"GET /x HTTP/1.1\r\nHost: t\r\nUpgrade: h2c\r\n\r\n",
    "websocket-upgrade": (
        b"GET /ws HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ),
    "connect": b"CONNECT t:443 HTTP/1.1\r\nHost: t:443\r\n\r\n",
    "bad-header-name": b"GET /x HTTP/1.1\r\nHost: t\r\nBad(Name: 1\r\n\r\n",
    "control-character-in-value": b"GET /x HTTP/1.1\r\nHost: t\r\nX-A: a\x01b\r\n\r\n",
    "absolute-form-target": b"GET http://t/x HTTP/1.1\r\nHost: t\r\n\r\n",
    "two-content-lengths": (
        b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\na"
    ),
    "over-100-header-lines": (
        b"GET /x HTTP/1.1\r\nHost: t\r\n"
        + b"".join(b"X-%d: v\r\n" % i for i in range(100))
        + b"\r\n"
    ),
    "two-hosts": b"GET /x HTTP/1.1\r\nHost: t\r\nHost: u\r\n\r\n",
    "no-host": b"GET /x HTTP/1.1\r\nX-A: b\r\n\r\n",
    "bare-line-feeds": b"GET /x HTTP/1.1\nHost: t\n\n",
    "a-bare-line-feed-then-crlf": b"GET /x HTTP/1.1\nHost: t\r\n\r\n",
    "head-over-8-KiB": b"GET /x HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    "close-then-more-bytes": b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n" + GET,
}
NOT_SERVED = b"GET /aiohttp/a HTTP/1.1\r\nHost: t\r\n\r\n"


class TestHandOver:
    """A request the front does not frame goes to aiohttp with the connection, every byte
    from the request's first."""

    @pytest.mark.parametrize("request_bytes", HANDED_OVER.values(), ids=HANDED_OVER.keys())
    async def test_a_request_it_does_not_frame_is_handed_over(
        self, start: Start, request_bytes: bytes
    ) -> None:
        """aiohttp's protocol gets the request's bytes exactly, then whatever follows on
        the connection, and its answer reaches the client; no call is made, and the
        connection is off the front's list."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(request_bytes)
        recorder = await served.recorder()
        assert await recorder.received(len(request_bytes)) == request_bytes
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(CANNED)) == CANNED
        writer.write(GET)
        assert await recorder.received(len(request_bytes + GET)) == request_bytes + GET
        assert served.dispatch.seen == []
        assert served.dispatch.tasks == []
        assert len(served.dispatch.recorders) == 1
        [(front, _)] = served.on
        assert served.off == [front]

    async def test_a_bare_line_feed_in_half_a_head_is_handed_over_at_once(
        self, start: Start
    ) -> None:
        """A bare LF before the head's end: aiohttp's to refuse, not held until the header
        timeout."""
        served = await start(header_timeout_s=30.0)
        _, writer = await served.connect()
        request_bytes = b"GET /x HTTP/1.1\nHost: t\n"
        writer.write(request_bytes)
        recorder = await served.recorder()
        assert await recorder.received(len(request_bytes)) == request_bytes

    async def test_a_head_over_8_kib_still_arriving_is_handed_over(self, start: Start) -> None:
        """More than 8 KiB without the head's end: handed over before the end comes."""
        served = await start()
        reader, writer = await served.connect()
        first = b"GET /x HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 9000
        writer.write(first)
        recorder = await served.recorder()
        assert await recorder.received(len(first)) == first
        writer.write(b"\r\n\r\n")
        assert await recorder.received(len(first) + 4) == first + b"\r\n\r\n"
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(CANNED)) == CANNED
        assert served.dispatch.seen == []

    async def test_a_request_after_a_served_one_in_the_same_write(self, start: Start) -> None:
        """The served request is answered here; aiohttp gets exactly the second's bytes,
        then the rest of the connection."""
        served = await start()
        reader, writer = await served.connect()
        second = b"GET /x HTTP/1.0\r\nHost: t\r\n\r\n"
        writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc" + second)
        assert (await read_answer(reader)).body == b"POST /x 3"
        recorder = await served.recorder()
        assert await recorder.received(len(second)) == second
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(CANNED)) == CANNED
        writer.write(GET)
        assert await recorder.received(len(second + GET)) == second + GET
        assert [seen.raw_path for seen in served.dispatch.seen] == ["/x"]

    async def test_an_overloaded_request_whose_body_is_coming_is_handed_over(
        self, start: Start
    ) -> None:
        """A call that would be shed while its body is still coming is aiohttp's, body and
        all: admit is not asked."""
        served = await start()
        served.dispatch.shed = 1
        _, writer = await served.connect()
        head = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc"
        writer.write(head)
        recorder = await served.recorder()
        assert await recorder.received(len(head)) == head
        writer.write(b"defghij")
        assert await recorder.received(len(head) + 7) == head + b"defghij"
        assert served.dispatch.shed == 1
        assert served.dispatch.seen == []

    @pytest.mark.parametrize("target", ["/x", "/aiohttp/x"])
    async def test_an_overloaded_request_with_its_body_in_is_shed_here(
        self, start: Start, target: str
    ) -> None:
        """Overloaded with its body all in, served or not: the front writes the shed answer,
        and the connection stays the front's."""
        served = await start()
        served.dispatch.shed = 1
        reader, writer = await served.connect()
        writer.write(f"POST {target} HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc".encode())
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(SHED)) == SHED
        assert served.dispatch.recorders == []
        assert served.dispatch.tasks == []
        writer.write(GET)  # read after the shed pause, by the front
        assert (await read_answer(reader)).body == b"GET /x 0"
        assert served.dispatch.recorders == []


class TestLend:
    """A request the front frames but does not serve is lent to aiohttp: exactly its bytes,
    and the connection comes back once it is answered."""

    async def test_a_request_it_does_not_serve_is_lent(self, start: Start) -> None:
        """aiohttp's protocol gets exactly the request; the next one is the front's."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(NOT_SERVED)
        recorder = await served.recorder()
        assert await recorder.received(len(NOT_SERVED)) == NOT_SERVED
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(CANNED)) == CANNED
        writer.write(GET)
        assert (await read_answer(reader)).body == b"GET /x 0"
        assert recorder.data == NOT_SERVED
        assert served.off == []  # still the front's
        assert len(served.dispatch.recorders) == 1

    async def test_a_lent_body_in_pieces_and_a_request_behind_it(self, start: Start) -> None:
        """A lent request's body, arriving in pieces, goes to aiohttp to its last byte and
        no further: the request pipelined behind it is the front's."""
        served = await start()
        reader, writer = await served.connect()
        head = b"POST /aiohttp/b HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n"
        writer.write(head + b"abc")
        recorder = await served.recorder()
        assert await recorder.received(len(head) + 3) == head + b"abc"
        writer.write(b"defghij" + GET)
        assert await recorder.received(len(head) + 10) == head + b"abcdefghij"
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(CANNED)) == CANNED
        assert (await read_answer(reader)).body == b"GET /x 0"
        assert recorder.data == head + b"abcdefghij"

    async def test_served_lent_served_in_one_write(self, start: Start) -> None:
        """Pipelined around a lent request, each is answered in its turn."""
        served = await start()
        reader, writer = await served.connect()
        first = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
        writer.write(first + NOT_SERVED + b"GET /third HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_answer(reader)).body == b"POST /x 3"
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(CANNED)) == CANNED
        assert (await read_answer(reader)).body == b"GET /third 0"
        recorder = await served.recorder()
        assert recorder.data == NOT_SERVED
        assert [seen.raw_path for seen in served.dispatch.seen] == ["/x", "/third"]

    async def test_reading_resumes_after_a_lent_request_past_the_high_water(
        self, start: Start
    ) -> None:
        """A MB pipelined behind a lent request pauses reading; once the lent request is
        answered, the MB's request is read whole and answered."""
        reader, writer, _, transport, _, hold = await (await start()).lent_and_held()
        body = b"z" * 1_000_000
        writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n" + body)
        await eventually(lambda: not transport.is_reading())
        hold.set()
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(CANNED)) == CANNED
        async with asyncio.timeout(3.0):
            assert (await read_answer(reader)).body == b"POST /x 1000000"

    async def test_a_client_gone_while_a_request_is_lent(self, start: Start) -> None:
        """aiohttp's protocol is told the connection is lost, and the connection leaves the
        server's list."""
        served = await start()
        _, writer, front, _, recorder, _ = await served.lent_and_held()
        writer.close()
        await eventually(lambda: recorder.lost)
        await eventually(lambda: served.off == [front])

    async def test_close_waits_for_a_lent_request(self, start: Start) -> None:
        """close() while a request is lent: aiohttp's answer goes out, then the close."""
        reader, _, front, _, _, hold = await (await start()).lent_and_held()
        front.close()
        await still_open(reader, 0.3)
        hold.set()
        assert await at_eof(reader) == CANNED

    async def test_shutdown_waits_for_a_lent_request(self, start: Start) -> None:
        """shutdown(timeout) while a request is lent returns once it is answered."""
        reader, _, front, _, _, hold = await (await start()).lent_and_held()
        shutting = asyncio.create_task(front.shutdown(WAIT))
        await asyncio.sleep(0.2)
        assert not shutting.done()
        hold.set()
        async with asyncio.timeout(WAIT):
            await shutting
        assert await at_eof(reader) == CANNED


CLOSING = {
    "get": b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    "content-length-0": (
        b"POST /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    ),
    "with-a-body": (
        b"POST /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 2\r\n\r\nab"
    ),
    "in-a-list": b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: keep-alive, Close\r\n\r\n",
}


class TestConnectionClose:
    """A client's `Connection: close` ends the connection after its answer."""

    @pytest.mark.parametrize("request_bytes", CLOSING.values(), ids=CLOSING.keys())
    async def test_the_answer_says_close_then_the_connection_closes(
        self, start: Start, request_bytes: bytes
    ) -> None:
        """The answer carries `Connection: close`, and the connection ends after it."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(request_bytes)
        answer = await read_answer(reader)
        assert answer.status == 200
        assert answer.headers["Connection"] == "close"
        assert await at_eof(reader) == b""
        assert len(served.dispatch.seen) == 1
        assert served.dispatch.recorders == []
        await eventually(lambda: len(served.off) == 1)

    async def test_a_request_sent_after_close_during_the_call_is_not_served(
        self, start: Start
    ) -> None:
        """Bytes after a `Connection: close` request, arriving while it is served, are
        never read as a request."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(b"GET /wait HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        await eventually(lambda: "start /wait" in served.dispatch.events)
        writer.write(GET)
        await asyncio.sleep(0.05)
        served.dispatch.gate.set()
        answer = await read_answer(reader)
        assert (answer.headers["Connection"], answer.body) == ("close", b"GET /wait 0")
        assert await at_eof(reader) == b""
        assert [seen.raw_path for seen in served.dispatch.seen] == ["/wait"]
        assert served.dispatch.recorders == []


class TestTimers:
    """The header timeout and the keep-alive timeout close a connection that owes a head."""

    async def test_a_silent_connection_closes_after_the_header_timeout(self, start: Start) -> None:
        """A connection that sends nothing is closed once the header timeout has passed."""
        served = await start(header_timeout_s=0.3)
        reader, _ = await served.connect()
        began = now()
        assert await at_eof(reader) == b""
        assert now() - began >= 0.2
        await eventually(lambda: len(served.off) == 1)

    async def test_half_a_head_trickling_in_closes_after_the_header_timeout(
        self, start: Start
    ) -> None:
        """The timeout counts from the opening: more bytes of the head do not restart it."""
        served = await start(header_timeout_s=0.3)
        reader, writer = await served.connect()
        writer.write(b"GET /x HTTP/1.1\r\n")

        async def trickle() -> None:
            while not reader.at_eof() and not writer.is_closing():
                writer.write(b"X-A: b\r\n")
                await asyncio.sleep(0.05)

        trickling = asyncio.create_task(trickle())
        began = now()
        try:
            assert await at_eof(reader, within=3.0) == b""
        finally:
            trickling.cancel()
        assert 0.2 <= now() - began < 3.0
        assert served.dispatch.seen == []

    async def test_an_idle_connection_closes_after_the_keepalive_timeout(
        self, start: Start
    ) -> None:
        """After an answer, a connection that sends nothing closes after the keep-alive
        timeout."""
        served = await start(header_timeout_s=30.0, keepalive_timeout_s=0.3)
        reader, writer = await served.connect()
        writer.write(GET)
        await read_answer(reader)
        began = now()
        assert await at_eof(reader, within=5.0) == b""
        assert now() - began >= 0.2

    async def test_no_timer_runs_while_a_request_is_lent(self, start: Start) -> None:
        """A lent request answered after both timeouts have passed keeps its connection;
        once it is back and idle, the keep-alive timeout closes it."""
        served = await start(header_timeout_s=0.3, keepalive_timeout_s=0.3)
        reader, _, _, _, _, hold = await served.lent_and_held()
        await still_open(reader, 0.8)
        hold.set()
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(CANNED)) == CANNED
        began = now()
        assert await at_eof(reader) == b""
        assert now() - began >= 0.2

    async def test_a_head_begun_on_a_kept_connection_owes_the_header_timeout(
        self, start: Start
    ) -> None:
        """Bytes of a next head replace the keep-alive timer with the header timer."""
        served = await start(header_timeout_s=0.3, keepalive_timeout_s=30.0)
        reader, writer = await served.connect()
        writer.write(GET)
        await read_answer(reader)
        writer.write(b"GET /y HTTP/1.1\r\n")
        began = now()
        assert await at_eof(reader, within=5.0) == b""
        assert 0.2 <= now() - began < 5.0


class TestShed:
    """A shed call is answered from its head, then the connection rests a second."""

    async def test_a_shed_answer_then_a_second_unread(self, start: Start) -> None:
        """The shed bytes go out at once; a request sent with it is answered a second
        later."""
        served = await start()
        served.dispatch.shed = 1
        reader, writer = await served.connect()
        began = now()
        writer.write(b"GET /shed HTTP/1.1\r\nHost: t\r\n\r\n" + GET)
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(SHED)) == SHED
        assert (await read_answer(reader)).body == b"GET /x 0"
        assert 0.9 <= now() - began < WAIT
        assert [seen.raw_path for seen in served.dispatch.seen] == ["/x"]

    async def test_a_shed_request_asking_to_close_is_closed(self, start: Start) -> None:
        """A shed request with `Connection: close`: its shed answer, then the close at once
        (no pause)."""
        served = await start()
        served.dispatch.shed = 1
        reader, writer = await served.connect()
        writer.write(
            b"POST /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 2\r\n\r\nab"
        )
        began = now()
        assert await at_eof(reader) == SHED
        assert served.dispatch.tasks == []
        assert now() - began < WAIT

    async def test_a_connection_idle_after_a_shed_closes_after_the_keepalive_timeout(
        self, start: Start
    ) -> None:
        """Idle after the shed answer and its pause: the keep-alive timeout closes it."""
        served = await start(header_timeout_s=0.3, keepalive_timeout_s=0.3)
        served.dispatch.shed = 1
        reader, writer = await served.connect()
        writer.write(GET)
        began = now()
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(SHED)) == SHED
        assert await at_eof(reader) == b""
        assert now() - began >= 0.2


class TestBacklog:
    """While the process is full, a whole head waits for its turn in the backlog, then is
    served as it would have been when it came (gateway.wire.backlog)."""

    async def test_a_head_that_comes_while_full_is_shed_in_its_turn(self, start: Start) -> None:
        served = await start(full=lambda: True)
        served.dispatch.shed = 1
        reader, writer = await served.connect()
        writer.write(b"GET /crowd HTTP/1.1\r\nHost: t\r\n\r\n")
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(SHED)) == SHED
        assert served.dispatch.admitted == [("/crowd", True)]  # shed as it was when it came

    async def test_heads_that_wait_are_taken_in_the_order_they_came(self) -> None:
        """Five connections' heads waiting at once, each answered in the order it came."""
        dispatch = FakeDispatch()
        dispatch.shed = 5
        backlog = Backlog(lambda: True)
        waiting = [quiet_front(dispatch, backlog) for _ in range(5)]
        for n, (front, _) in enumerate(waiting):
            front.data_received(b"GET /%d HTTP/1.1\r\nHost: t\r\n\r\n" % n)
        assert len(backlog) == 5 and dispatch.admitted == []  # none answered where it was read
        await asyncio.sleep(0)  # their turn
        assert dispatch.admitted == [(f"/{n}", True) for n in range(5)]
        assert all(transport.written == SHED for _, transport in waiting)

    async def test_while_not_full_a_head_is_served_where_it_is_read(self, start: Start) -> None:
        served = await start(full=lambda: False)
        reader, writer = await served.connect()
        writer.write(GET)
        assert (await read_answer(reader)).body == b"GET /x 0"
        assert served.dispatch.admitted == [("/x", False)]

    async def test_a_connection_gone_before_its_turn_is_passed_over(self) -> None:
        dispatch = FakeDispatch()
        dispatch.shed = 1
        backlog = Backlog(lambda: True)
        front, transport = quiet_front(dispatch, backlog)
        front.data_received(GET)
        assert len(backlog) == 1 and transport.written == b""  # waits for its turn
        front.connection_lost(None)
        await asyncio.sleep(0)  # its turn
        assert len(backlog) == 0
        assert dispatch.admitted == [] and transport.written == b""


def quiet_front(dispatch: FakeDispatch, backlog: Backlog) -> tuple[Front, QuietTransport]:
    """A front on a transport that only keeps what is written to it, its turns in `backlog`."""
    front = Front(
        dispatch,
        lambda front, transport: None,
        header_timeout_s=30.0,
        keepalive_timeout_s=30.0,
        backlog=backlog,
    )
    transport = QuietTransport()
    front.connection_made(transport)
    return front, transport


class QuietTransport(asyncio.Transport):
    """A transport that keeps what is written to it and reports nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class TestFlowControl:
    """Reading and writing both wait for the other side."""

    async def test_an_answer_waits_for_a_client_that_does_not_read(self, start: Start) -> None:
        """An answer of several MB to a client not reading: its writes wait, and finish once
        the client reads."""
        served = await start()
        reader, writer = await served.connect(rcvbuf=16 * 1024)
        front, transport = await served.front()
        transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024
        )
        writer.write(b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n")
        await eventually(lambda: front.writing_paused)
        await asyncio.sleep(0.3)
        [task] = served.dispatch.tasks
        assert not task.done()
        answer = await read_answer(reader)
        assert len(answer.body) == BIG
        async with asyncio.timeout(WAIT):
            await task
        assert served.dispatch.events == ["start /big", "end /big"]

    async def test_reading_pauses_past_the_high_water_while_a_call_runs(self, start: Start) -> None:
        """A MB pipelined behind a call in progress: reading pauses, and resumes once the
        call is answered."""
        served = await start()
        reader, writer = await served.connect()
        _, transport = await served.front()
        writer.write(b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\n")
        await eventually(lambda: "start /wait" in served.dispatch.events)
        body = b"z" * 1_000_000
        writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n" + body)
        await eventually(lambda: not transport.is_reading())
        served.dispatch.gate.set()
        assert (await read_answer(reader)).body == b"GET /wait 0"
        assert (await read_answer(reader)).body == b"POST /x 1000000"
        assert served.dispatch.seen[1].body == body
        assert transport.is_reading()


class TestBrokenBody:
    """A client gone mid-body breaks the call's read of it."""

    @pytest.mark.parametrize("how", ["fin", "reset"])
    async def test_a_client_gone_mid_body_breaks_iter_any(self, start: Start, how: str) -> None:
        """iter_any yields what came, then raises ConnectionResetError."""
        served = await start()
        _, writer = await served.connect()
        writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n" + b"a" * 10)
        await eventually(lambda: "start /x" in served.dispatch.events)
        await asyncio.sleep(0.05)
        if how == "reset":
            sock = writer.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()
        await eventually(lambda: bool(served.dispatch.broken))
        [(partial, error)] = served.dispatch.broken
        assert partial == b"a" * 10
        assert isinstance(error, ConnectionResetError)
        await eventually(lambda: len(served.off) == 1)  # off the list once the call ends


class TestUnreadBody:
    """A body the call leaves unread decides whether the connection goes on."""

    async def test_a_body_still_coming_and_unread_closes_the_connection(self, start: Start) -> None:
        """The call answers without reading a body still arriving: the answer, then the
        close (the body's rest is no request)."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(
            b"POST /unread HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n" + b"b" * 1000
        )
        assert (await read_answer(reader)).body == b"POST /unread 0"
        assert await at_eof(reader) == b""
        assert len(served.dispatch.seen) == 1

    async def test_a_body_all_in_but_unread_keeps_the_connection(self, start: Start) -> None:
        """A body all in when the call answers is consumed: the next request is served."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(b"POST /unread HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello" + GET)
        assert (await read_answer(reader)).body == b"POST /unread 0"
        assert (await read_answer(reader)).body == b"GET /x 0"


class TestShutdown:
    """`close()` and `shutdown(timeout)` let a call in progress finish, then close."""

    async def test_close_closes_an_idle_connection_at_once(self, start: Start) -> None:
        """An idle connection (new, or kept after an answer) is closed by close()."""
        served = await start()
        fresh_reader, _ = await served.connect()
        fresh, _ = await served.front(0)
        kept_reader, kept_writer = await served.connect()
        kept_writer.write(GET)
        await read_answer(kept_reader)
        kept, _ = await served.front(1)
        fresh.close()
        kept.close()
        assert await at_eof(fresh_reader, within=5.0) == b""
        assert await at_eof(kept_reader, within=5.0) == b""
        await eventually(lambda: set(served.off) == {fresh, kept})

    async def test_close_waits_for_the_call_in_progress(self, start: Start) -> None:
        """close() during a call: its answer goes out whole, then the close; a request
        pipelined behind it is not served."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\n" + GET)
        front, _ = await served.front()
        await eventually(lambda: "start /wait" in served.dispatch.events)
        front.close()
        await still_open(reader, 0.3)
        served.dispatch.gate.set()
        assert (await read_answer(reader)).body == b"GET /wait 0"
        assert await at_eof(reader) == b""
        assert [seen.raw_path for seen in served.dispatch.seen] == ["/wait"]
        await eventually(lambda: served.off == [front])

    async def test_shutdown_lets_the_call_finish_within_its_timeout(self, start: Start) -> None:
        """shutdown(timeout) waits for the call, which answers, then closes."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\n")
        front, _ = await served.front()
        await eventually(lambda: "start /wait" in served.dispatch.events)
        shutting = asyncio.create_task(front.shutdown(WAIT))
        await asyncio.sleep(0.2)
        assert not shutting.done()
        served.dispatch.gate.set()
        async with asyncio.timeout(WAIT):
            await shutting
        assert (await read_answer(reader)).body == b"GET /wait 0"
        assert await at_eof(reader) == b""
        assert not served.dispatch.tasks[0].cancelled()

    async def test_shutdown_cancels_a_call_past_its_timeout(self, start: Start) -> None:
        """A call not done within the timeout is cancelled and the connection closed."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\n")
        front, _ = await served.front()
        await eventually(lambda: "start /wait" in served.dispatch.events)
        began = now()
        async with asyncio.timeout(WAIT):
            await front.shutdown(0.3)
        assert now() - began >= 0.2
        assert await at_eof(reader) == b""
        [task] = served.dispatch.tasks
        await eventually(task.done)
        assert task.cancelled()
        await eventually(lambda: served.off == [front])

    async def test_close_then_shutdown_as_the_server_drains(self, start: Start) -> None:
        """aiohttp's runner calls close() on every connection, then shutdown(timeout): the
        call in progress is answered, and only then is the connection closed."""
        served = await start()
        reader, writer = await served.connect()
        writer.write(b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\n")
        front, _ = await served.front()
        await eventually(lambda: "start /wait" in served.dispatch.events)
        front.close()
        shutting = asyncio.create_task(front.shutdown(WAIT))
        await still_open(reader, 0.2)
        assert not shutting.done()
        served.dispatch.gate.set()
        async with asyncio.timeout(WAIT):
            await shutting
        assert (await read_answer(reader)).body == b"GET /wait 0"
        assert await at_eof(reader) == b""
