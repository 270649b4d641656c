"""A request the front serves (gateway.wire.front), its body, and the reply written for it.

`Incoming` carries what the call path reads of a request (the method, target, headers and
body, who sent it, and per-request values by key), under the names aiohttp's `web.Request`
gives them, so the call path reads either the same way. `Reply` writes an answer as aiohttp's
`StreamResponse` would (`prepare`, `write`, `write_eof`; Date and Server added when the
answer has none, Content-Length kept, chunked otherwise, no body to HEAD, 1xx, 204 and 304),
but the head goes out with the first write of the body, and nothing is built that the wire
does not need.
"""

from __future__ import annotations

import asyncio
import http
from collections.abc import AsyncIterator
from functools import cache
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

if TYPE_CHECKING:
    from gateway.wire.front import Front


class Body:
    """A request body as it arrives from the client: framed by its Content-Length, which
    the front has already checked."""

    __slots__ = ("_broken", "_chunks", "_eof", "_waiter")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._eof = False
        self._broken = False
        self._waiter: asyncio.Future[None] | None = None

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._wake()

    def end(self) -> None:
        self._eof = True
        self._wake()

    def broke(self) -> None:
        """The client's connection ended before the whole body came."""
        self._broken = True
        self._wake()

    def is_eof(self) -> bool:
        """The whole body has arrived (some of it may be unread), as aiohttp's says."""
        return self._eof

    def read_nowait(self) -> bytes:
        chunks, self._chunks = self._chunks, []
        return b"".join(chunks)

    async def iter_any(self) -> AsyncIterator[bytes]:
        """What has arrived, as it arrives, until the end."""
        while True:
            if self._chunks:
                yield self.read_nowait()
            elif self._eof:
                return
            elif self._broken:
                raise ConnectionResetError("the client's connection closed mid-body")
            else:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Incoming:
    """One request on a front connection, as the call path reads it."""

    __slots__ = (
        "_path",
        "_values",
        "app",
        "content",
        "content_length",
        "headers",
        "method",
        "must_close",
        "protocol",
        "raw_path",
        "replied",
    )

    def __init__(
        self,
        front: Front,
        method: str,
        target: str,
        headers: CIMultiDictProxy[str],
        content_length: int | None,
        must_close: bool,
    ) -> None:
        self.protocol = front
        self.method = method
        self.raw_path = target
        self.headers = headers
        self.content_length = content_length
        self.content = Body()
        self.must_close = must_close  # the client said Connection: close
        self.replied = False  # a reply's head went out
        self.app: Any = None  # the server's application, set when the call is dispatched
        self._path: str | None = None
        self._values: dict[Any, Any] = {}

    @property
    def path(self) -> str:
        """The path, percent-decoded as aiohttp's `request.path` is, without the query."""
        if self._path is None:
            raw = self.raw_path.partition("?")[0]
            self._path = URL.build(path=raw, encoded=True).path if "%" in raw else raw
        return self._path

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.protocol.transport

    @property
    def remote(self) -> str | None:
        return self.protocol.remote

    @property
    def scheme(self) -> str:
        return self.protocol.scheme

    def __getitem__(self, key: Any) -> Any:
        return self._values[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._values[key] = value

    def get(self, key: Any, default: Any = None) -> Any:
        return self._values.get(key, default)

    def reply(self, status: int) -> Reply:
        return Reply(self, status)


@cache
def _status_line(status: int) -> str:
    try:
        reason = http.HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    return f"HTTP/1.1 {status} {reason}\r\n"


class Reply(web.StreamResponse):
    """An answer written to a front connection: the head with the first write. A
    `StreamResponse` to whoever reads its status and headers (the edge's log line, metrics
    and trace), with aiohttp's writer replaced by the front's transport."""

    def __init__(self, request: Incoming, status: int) -> None:
        super().__init__(status=status)
        self._request = request
        self._started = False
        self._ended = False
        self._chunked = False
        self._no_body = False

    @property
    def prepared(self) -> bool:
        return self._started

    async def prepare(self, request: object) -> None:
        """Nothing goes out yet: the head waits for the first write."""
        return None

    async def write(self, data: bytes | bytearray | memoryview[int] | memoryview[bytes]) -> None:
        chunk = bytes(data)
        if not self._started:
            self._send(self._head() + (b"" if self._no_body else self._framed(chunk)))
        elif chunk and not self._no_body:
            self._send(self._framed(chunk))
        await self._request.protocol.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        if self._ended:
            return
        if data:
            await self.write(data)
        if not self._started:
            self._send(self._head())
        if self._chunked:
            self._send(b"0\r\n\r\n")
        self._ended = True
        await self._request.protocol.drain()

    def _framed(self, data: bytes) -> bytes:
        if not self._chunked or not data:
            return data
        return b"%x\r\n%b\r\n" % (len(data), data)

    def _head(self) -> bytes:
        self._started = self._request.replied = True
        headers, status = self.headers, self.status
        bodiless_status = _bodiless(status, to_head=False)
        self._no_body = bodiless_status or self._request.method == "HEAD"
        if bodiless_status:  # no body, and no length of one (RFC 9110)
            headers.popall("Content-Length", None)
        elif "Content-Length" not in headers and not self._no_body:
            headers["Transfer-Encoding"] = "chunked"
            self._chunked = True
        return encode(status, headers, close=self._request.must_close)

    def _send(self, data: bytes) -> None:
        transport = self._request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client's connection is closed")
        transport.write(data)


def encode(status: int, headers: CIMultiDict[str], *, close: bool) -> bytes:
    """A response head as aiohttp writes one: Date and Server unless set, `Connection:
    close` when the connection ends after it. A CR or LF inside a value is refused, as
    aiohttp's writer refuses it."""
    lines = [_status_line(status)]
    lines += [f"{name}: {value}\r\n" for name, value in headers.items()]
    if "Date" not in headers:
        lines.append(f"Date: {rfc822_formatted_time()}\r\n")
    if "Server" not in headers:
        lines.append(f"Server: {SERVER_SOFTWARE}\r\n")
    if close:
        lines.append("Connection: close\r\n")
    lines.append("\r\n")
    text = "".join(lines)
    if text.count("\n") != len(lines) or text.count("\r") != len(lines):
        raise ValueError("a CR or LF inside a response header")
    return text.encode("utf-8", "surrogateescape")


def whole(
    status: int, headers: CIMultiDict[str], body: bytes, *, close: bool, to_head: bool
) -> bytes:
    """A whole answer of known body (one of the gateway's own: a refusal, a shed call's 503)
    as bytes to write, its Content-Length added to `headers`; no body after the head of an
    answer to HEAD (`to_head`), a 204 or a 304."""
    headers["Content-Length"] = str(len(body))
    return encode(status, headers, close=close) + (b"" if _bodiless(status, to_head) else body)


def _bodiless(status: int, to_head: bool) -> bool:
    """An answer that has no body whatever its headers say: to HEAD, 1xx, 204, 304."""
    return to_head or status < 200 or status in (204, 304)
