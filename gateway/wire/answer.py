"""An upstream's answer, read by httptools' strict response parser (llhttp, no leniency).

One `Answer` per exchange, with a parser of its own: the parser cannot be told that a request
was HEAD, so the answer to one ends at its head here, whatever its Content-Length says, and a
fresh parser reads the next exchange's answer. Interim answers (100 Continue, 103 Early Hints)
are read and dropped; the first final answer is the one. 204 and 304 have no body (the parser
knows); a body is framed by Content-Length, chunked, or runs until the connection closes.

What tells the connection it may carry another exchange: the answer ended as framed, the tool
did not say `Connection: close`, and no byte came after the end (`leftover`). A tool that
sends more than its framing says (a body longer than its Content-Length, an answer nobody
asked for) has put bytes on the connection that would otherwise be read as the next call's
answer: the connection is dropped instead.

The body is buffered as it arrives; past `HIGH_WATER` bytes not yet read the connection stops
reading from the tool (`pause_reading`) until the reader has taken it below `LOW_WATER`, so a
client that drains slowly slows the tool down instead of filling the gateway's memory.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

import httptools
from multidict import CIMultiDict

from gateway.wire.errors import BrokenAnswer, HandshakeRefused, ProtocolError, ReadError

if TYPE_CHECKING:
    from gateway.wire.connection import Connection

# An answer's head (its interim answers included) may take this many bytes, give or take the
# last read, and this many header lines (aiohttp's client allowed 128 too): a tool that never
# ends its head is cut off there, not at the deadline with the head in memory.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
# Body bytes buffered and not yet read: reading from the tool pauses above HIGH_WATER and
# resumes at LOW_WATER.
HIGH_WATER = 128 * 1024
LOW_WATER = 64 * 1024


class Answer:
    """The status, headers and body of one answer, as they arrive; `read` the body."""

    def __init__(self, connection: Connection, head_only: bool) -> None:
        self._connection = connection
        self._head_only = head_only  # an answer to HEAD: it ends with its head
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self._fields: list[tuple[str, str]] = []
        self._head_bytes = 0
        self._interim = False  # the message being parsed is a 1xx
        self.has_head = False  # the final answer's head is in
        self.ended = False  # the whole answer is in, as its framing says
        self.keep_alive = False  # the tool keeps the connection open after it
        self.leftover = False  # bytes came after the end: the connection is spoiled
        self._until_close = False  # the body ends when the connection does
        self._error: BrokenAnswer | HandshakeRefused | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._released = False

    # -- what the connection feeds in ----------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Bytes from the tool. After an error, or once spoiled, nothing more is read."""
        if not self.has_head:
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(ProtocolError(f"the answer's head is over {MAX_HEAD_BYTES} bytes"))
                return
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._spoil_or_fail(ProtocolError("the tool switched protocols (101) unasked"))
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._spoil_or_fail(
                cause if isinstance(cause, BrokenAnswer) else ProtocolError(str(exc))
            )

    def connection_ended(self, exc: BaseException | None) -> None:
        """The tool closed the connection (`exc` None) or it failed."""
        if self.ended:
            return
        if self.has_head and self._until_close and exc is None:
            self.ended = True  # a close-delimited body ends here
            self._wake()
            return
        what = "body" if self.has_head else "head"
        reason = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        self._fail(ReadError(f"the connection closed before the answer's {what} ended{reason}"))

    @property
    def spoiled(self) -> bool:
        """The connection can carry nothing more: an error, or bytes after the end."""
        return self._error is not None or self.leftover

    @property
    def clean(self) -> bool:
        """Ended as framed, nothing after it, and the tool keeps the connection open."""
        return self.ended and self.keep_alive and not self.spoiled

    def _spoil_or_fail(self, error: BrokenAnswer) -> None:
        if self.ended:
            self.leftover = True  # what follows a whole answer is nobody's answer
        else:
            self._fail(error)

    @property
    def heard(self) -> bool:
        """Some byte of an answer arrived."""
        return self._head_bytes > 0

    def refused(self, error: HandshakeRefused) -> None:
        """The peer's TLS layer refused the connection before it passed anything on."""
        self._fail(error)

    def _fail(self, error: BrokenAnswer | HandshakeRefused) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- httptools' callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.ended:
            self.leftover = True
        self._fields = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.has_head:
            return  # a chunked body's trailer: not passed on, as before
        if len(self._fields) >= MAX_HEADERS:
            raise ProtocolError(f"the answer has more than {MAX_HEADERS} headers")
        # names are tokens (the parser checks); values as aiohttp's client decoded them
        self._fields.append(
            (name.decode("latin-1"), value.rstrip(b" \t").decode("utf-8", "surrogateescape"))
        )

    def on_headers_complete(self) -> None:
        if self.ended:
            return
        status = self._parser.get_status_code()
        if status < 100:
            raise ProtocolError(f"status {status} is no HTTP status")
        if status < 200:
            if status == 101:
                raise ProtocolError("the tool switched protocols (101) unasked")
            self._interim = True  # 100 Continue, 103 Early Hints: the final answer follows
            return
        self.status = status
        self.headers = headers = CIMultiDict(self._fields)
        self.keep_alive = self._parser.should_keep_alive()
        chunked = headers.get("Transfer-Encoding", "").rpartition(",")[2].strip().lower()
        self._until_close = "Content-Length" not in headers and chunked != "chunked"
        self.has_head = True
        if self._head_only:
            self.ended = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.ended:
            self.leftover = True  # a body after an answer to HEAD
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER:
            self._connection.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if not self.ended:
            self.ended = True
            self._wake()

    # -- what the call path reads ------------------------------------------------------------

    async def wait_head(self, deadline: float | None = None) -> None:
        """Until the final answer's head is in; raise `BrokenAnswer`, or `TimeoutError` at
        `deadline` (loop time)."""
        while not self.has_head:
            if self._error is not None:
                raise self._error
            await self._wait(deadline)

    async def read(self, limit: int = -1, deadline: float | None = None) -> bytes:
        """Up to `limit` (any, when negative) body bytes as they come; b"" once the answer
        ended. Raise `BrokenAnswer` when it broke, after what arrived before was read, or
        `TimeoutError` when nothing came by `deadline` (loop time)."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.ended:
                return b""
            await self._wait(deadline)
        chunk = self._chunks[0]
        if 0 <= limit < len(chunk):
            self._chunks[0] = chunk[limit:]
            chunk = chunk[:limit]
        else:
            self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._buffered <= LOW_WATER:
            self._connection.resume_reading()
        return chunk

    def read_nowait(self) -> bytes:
        """The body bytes that have arrived and are not read yet, without waiting (b"" when
        none have); what broke the answer is `read`'s to raise."""
        if not self._chunks:
            return b""
        chunk = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._connection.resume_reading()
        return chunk

    def at_eof(self) -> bool:
        """The answer ended and every byte of it was read."""
        return self.ended and not self._chunks

    async def _wait(self, deadline: float | None) -> None:
        """Until `_wake`. The deadline's timer is set only here, where the reader waits: a
        read of what has arrived already (most reads) costs no timer, as a timeout scope
        around it would."""
        loop = self._connection.loop
        waiter = self._waiter = loop.create_future()
        timer = None if deadline is None else loop.call_at(deadline, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool, or is closed."""
        if not self._released:
            self._released = True
            self._connection.finish(self)

    async def __aenter__(self) -> Answer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
