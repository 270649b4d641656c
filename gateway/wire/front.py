"""The front: the gateway's own server protocol, which every client connection starts on
(docs/contract.md §5; docs/design/architecture.md, "The front").

The front finds a head's end and a body's length itself and parses the head with httptools
(llhttp, no lenient flag). It frames a request when nothing about it is unusual: HTTP/1.1,
no body or one framed by a single Content-Length, no Transfer-Encoding, Upgrade or Expect, a
Host and no second copy of a header aiohttp takes once, an origin-form ASCII target, every
header name a token and every value free of control characters and valid UTF-8, CRLF line
ends, the whole head well inside aiohttp's size limits. A framed request is then

* served, when `Dispatch.serves` says it is a proxied call: the call path reads it as an
  `Incoming` and answers with a `Reply`;
* lent to aiohttp's protocol otherwise (a `/_gateway/` call, the console, an MCP POST, a
  path no upstream is mounted at): a fresh one gets the transport and exactly this request's
  bytes, answers it as aiohttp always did, and gives the connection back (`_returned`) at the
  request boundary the front knows, or closes it.

A request the front does not frame goes to aiohttp's protocol with the rest of the
connection, for good (`_hand_over`): the front keeps a request's bytes until it dispatches
it, so aiohttp gets them from the request's first byte, and its own limits, refusals and
answers apply to that request and every later one on the connection.

What the front itself owns, as aiohttp's server did for these requests: one request at a
time per connection (a pipelined request waits until the answer before it is written), the
header timeout (a connection must send a whole head within `header_timeout_s` of its first
byte, or of opening), the idle keep-alive timeout, a body that must arrive within the body
timeout (the call path's `read_body` waits for it), flow control both ways (reading pauses
while a call is in progress and more than `_HIGH_WATER` bytes are waiting; an answer's writes
wait while the client does not read), `Connection: close`, the overload limit's answers from
the head (a whole head that comes while the process is full waits for its turn in the
backlog, gateway.wire.backlog, and is then served as it would have been when it came), and
the drain at shutdown (a request in progress is let finish within the grace period).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any, Protocol, cast

import httptools
from aiohttp.http_parser import SINGLETON_HEADERS
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.core.grammar import HTTP_TOKEN
from gateway.wire.backlog import Backlog
from gateway.wire.incoming import Incoming

# Heads at or near any of aiohttp's limits (8,190 bytes a line, 128 headers) go to aiohttp,
# which refuses them as it always did.
_MAX_HEAD = 8 * 1024
_MAX_FIELDS = 100
# Bytes kept waiting while a call is in progress before reading from the client pauses.
_HIGH_WATER = 256 * 1024
# The whole of a head the front frames, in one match: a method, an origin-form ASCII target,
# HTTP/1.1, then at most _MAX_FIELDS header lines, each a token, a colon and a value of
# visible characters, spaces and tabs (and obs-text), every line ending in CRLF. Anything
# else (a bare CR or LF, a folded line, an absolute target) is aiohttp's to refuse or serve.
_HEAD = re.compile(
    rb"(?P<method>" + HTTP_TOKEN.encode() + rb") (?P<target>/[\x21-\x7e]*) HTTP/1\.1\r\n"
    rb"(?P<fields>(?:"
    + HTTP_TOKEN.encode()
    + rb":[\t\x20-\x7e\x80-\xff]*\r\n){1,%d})\r\n" % _MAX_FIELDS
)
_DIGITS = re.compile(r"[0-9]{1,15}")
# Headers that make a request the front does not frame: aiohttp's
_NOT_FRAMED = frozenset({"transfer-encoding", "upgrade", "expect"})
# Headers aiohttp's parsers refuse to see twice: a head with two of one goes to aiohttp,
# which refuses it as it always did; so does one without Host.
_ONCE = frozenset(name.lower() for name in SINGLETON_HEADERS)


class Dispatch(Protocol):
    """What the server layer gives the front: which requests are its, what serves them, and
    aiohttp's protocol for everything else."""

    def serves(self, incoming: Incoming) -> bool:
        """Whether the request is a call the front serves (its head is all it has read)."""

    def call(self, incoming: Incoming) -> asyncio.Task[None]:
        """Serve `incoming`; the task ends when its answer is written (or can't be)."""

    app: Any  # the server's application: what the call path reads off a request

    @property
    def retry_after_s(self) -> float:
        """How long the connection of a shed call is left unread."""

    def overloaded(self, incoming: Incoming, *, waited: bool = False) -> bool:
        """Whether the call would be shed (GATEWAY_MAX_INFLIGHT), deciding nothing: a call
        the front would hand over is shed here all the same, when it can be answered now.
        `waited`: its head waited in the backlog, having come while the process was full,
        and is shed as it would have been then."""

    def admit(self, incoming: Incoming, *, waited: bool = False) -> bytes | None:
        """The whole answer to write at once when the call is shed; None when it is taken
        (and counted until its answer is written)."""

    def aiohttp_protocol(self, returned: Callable[[], None] | None = None) -> asyncio.Protocol:
        """A new aiohttp request handler: for a connection the front hands over, or, with
        `returned`, lent one request, which calls `returned` once it has let go of the
        transport after answering it with the connection kept open."""


class _NotTold:
    """httptools' callbacks for a head the front has matched already: none (each would be
    a Python call per header line)."""


_NOT_TOLD = _NotTold()


class Front(asyncio.Protocol):
    """One client connection, served here until a request it does not frame."""

    def __init__(
        self,
        dispatch: Dispatch,
        register: Callable[[Front, asyncio.Transport | None], None],
        *,
        header_timeout_s: float,
        keepalive_timeout_s: float,
        backlog: Backlog | None = None,
    ) -> None:
        self._dispatch = dispatch
        self._backlog = backlog  # None: every head is served where it is read
        self._register = register  # (self, transport) on; (self, None) off the server's list
        self._header_timeout_s = header_timeout_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._calling: asyncio.Task[None] | None = None
        self._lent: asyncio.Protocol | None = None  # aiohttp's, for one request
        self._incoming: Incoming | None = None
        self._body_left = 0  # bytes of the current request's body still to come
        self._idle: asyncio.Future[None] | None = None  # for a drain: no call, nothing lent
        self._timer: asyncio.TimerHandle | None = None
        self._keepalive_timer = False  # the timer running is the idle one, not a head's
        self._reading_paused = False
        self._closing = False  # close once the call in progress is answered
        self._shed_pause: asyncio.TimerHandle | None = None
        self._queued = False  # its whole head waits in the backlog
        self.writing_paused = False
        self._drained: asyncio.Future[None] | None = None
        self.remote: str | None = None
        self.scheme = "http"

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)  # TCP or TLS
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else None
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        self._register(self, transport)
        self._set_timer(self._header_timeout_s)  # a new connection owes a head

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._body_left:
            self._feed_body()
        if self._calling is None and self._lent is None and self._shed_pause is None:
            self._next()
        elif len(self._buffer) > _HIGH_WATER:
            self._pause_reading()  # pipelined requests pile up: read no more for now

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._shed_pause is not None:
            self._shed_pause.cancel()
        if self._incoming is not None and self._body_left:
            self._incoming.content.broke()
        self._transport = None
        self._wake_writer()
        lent, self._lent = self._lent, None
        if lent is not None:
            lent.connection_lost(exc)
        if self._calling is None:
            self._register(self, None)
            self._now_idle()
        # else: the call goes on (an admitted call completes though its client left); the
        # connection leaves the server's list when it is done (`_answered`)

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self._lent is not None:
            self._lent.pause_writing()

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_writer()
        if self._lent is not None:
            self._lent.resume_writing()
        elif self._idle_between_requests():
            self._next()  # a whole head waited for the client to read what it was sent

    # -- what Reply and the server use --------------------------------------------------------

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._transport

    async def drain(self) -> None:
        """Wait until the client has read enough of what was written (or is gone)."""
        if self.writing_paused and self._transport is not None:
            if self._drained is None:
                self._drained = self._loop.create_future()
            await self._drained
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("the client's connection is closed")

    def close(self) -> None:
        """At shutdown: close now if idle, else once the request in progress is answered."""
        self._closing = True
        if self._calling is None and self._lent is None:
            self._close()

    async def shutdown(self, timeout: float | None) -> None:
        """Let the request in progress be answered within `timeout`, then close (aiohttp's
        drain; a request lent to aiohttp is drained by aiohttp's protocol too)."""
        self._closing = True
        if self._calling is not None or self._lent is not None:
            self._idle = self._loop.create_future()
            await asyncio.wait([self._idle], timeout=timeout)
            if self._calling is not None:
                self._calling.cancel()
        self._close()

    # -- requests -----------------------------------------------------------------------------

    def _next(self, *, its_turn: bool = False) -> None:
        """Take the next request in the buffer, if its head is all in: now, or in its turn
        when the process is full (`its_turn`: the backlog gave it)."""
        buffer = self._buffer
        if not buffer:
            if self._timer is None:
                self._set_timer(self._keepalive_timeout_s, keepalive=True)
            return
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > _MAX_HEAD or buffer.count(b"\n") != buffer.count(b"\r\n"):
                self._hand_over()  # aiohttp's limits, or a bare LF: aiohttp decides what it is
            elif self._timer is None or self._keepalive_timer:
                self._set_timer(self._header_timeout_s)  # the first bytes of a head
            return
        self._cancel_timer()
        if self.writing_paused and not its_turn:
            # the client does not read what it was sent: its next request waits until it
            # does (`resume_writing`), as aiohttp's drain before the next request made it
            if len(buffer) > _HIGH_WATER:
                self._pause_reading()
            return
        backlog = self._backlog
        if backlog is not None and not its_turn and (self._queued or backlog.holds()):
            if not self._queued:
                self._queued = True
                backlog.add(self._its_turn)
            if len(buffer) > _HIGH_WATER:
                self._pause_reading()  # what a waiting connection sends is kept, up to here
            return
        head_end = end + 4
        parsed = self._parse(bytes(buffer[:head_end])) if head_end <= _MAX_HEAD else None
        if parsed is None:
            self._hand_over()
            return
        method, target, headers, length, close = parsed
        if close and len(buffer) > head_end + (length or 0):
            self._hand_over()  # bytes after `Connection: close`: aiohttp refuses them all
            return
        incoming = Incoming(self, method, target, headers, length, must_close=close)
        incoming.app = self._dispatch.app
        dispatch = self._dispatch
        if dispatch.overloaded(incoming, waited=its_turn):
            if (length is not None and len(buffer) - head_end < length) or self.writing_paused:
                # not to be answered before aiohttp would: its body still coming (which
                # aiohttp reads and drops), or the client not reading what it was sent
                self._hand_over()
                return
            shed = dispatch.admit(incoming, waited=its_turn)
            assert shed is not None  # overloaded: admit sheds it
            self._take(incoming, head_end, length)
            self._answer_shed(shed, incoming)
        elif dispatch.serves(incoming):
            dispatch.admit(incoming)  # counted: the limit is not reached, so it is not shed
            self._take(incoming, head_end, length)
            self._calling = dispatch.call(incoming)
            self._calling.add_done_callback(self._answered)
        else:
            self._lend(head_end, length)

    def _idle_between_requests(self) -> bool:
        """Nothing in progress on the open connection: no call, nothing lent, no shed pause,
        no turn awaited in the backlog, no close under way."""
        return (
            self._transport is not None
            and not self._closing
            and not self._transport.is_closing()
            and self._calling is None
            and self._lent is None
            and self._shed_pause is None
            and not self._queued
        )

    def _its_turn(self) -> None:
        """The backlog's turn for this connection's head (gateway.wire.backlog)."""
        self._queued = False
        if self._transport is None:  # gone, or handed to aiohttp, while it waited
            return
        if self._closing:
            self._close()  # shutting down: a head that waited is not begun
            return
        self._next(its_turn=True)

    def _take(self, incoming: Incoming, head_end: int, length: int | None) -> None:
        """The request is the front's: its head read off the buffer, its body fed to it
        (now what is in, the rest as it comes)."""
        del self._buffer[:head_end]
        self._incoming = incoming
        self._body_left = length or 0
        if self._body_left:
            self._feed_body()
        else:
            incoming.content.end()

    def _parse(
        self, head: bytes
    ) -> tuple[str, str, CIMultiDictProxy[str], int | None, bool] | None:
        """The method, target, headers, Content-Length and `Connection: close` of a head the
        front frames; None for any other (aiohttp's)."""
        shape = _HEAD.fullmatch(head)
        if shape is None:
            return None
        parser = httptools.HttpRequestParser(_NOT_TOLD)
        try:
            parser.feed_data(head)  # the method, and llhttp's own strictness over the rest
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            return None  # refused, or CONNECT (a tunnel): aiohttp's to answer
        if parser.should_upgrade():
            return None
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError:
            return None  # aiohttp refuses it, as it always did (gateway.server)
        length: int | None = None
        close = False
        seen: set[str] = set()
        pairs: list[tuple[str, str]] = []
        # up to its header lines the head is ASCII (a byte is a character); after them, CRLF
        for line in text[shape.start("fields") : -4].split("\r\n"):
            name, _, value = line.partition(":")
            value = value.strip(" \t")
            lowered = name.lower()
            if lowered in _NOT_FRAMED:
                return None
            if lowered in _ONCE:
                if lowered in seen:
                    return None
                seen.add(lowered)
                if lowered == "content-length":
                    if not _DIGITS.fullmatch(value):
                        return None
                    length = int(value)
            elif lowered == "connection":
                close = close or "close" in (t.strip().lower() for t in value.split(","))
            pairs.append((name, value))
        if "host" not in seen:
            return None
        # HTTP/1.1 keeps the connection unless the client says close (httptools' own answer
        # is lost once a message without a body has ended within the head)
        method, target = shape.group("method", "target")
        headers = CIMultiDictProxy(CIMultiDict(pairs))
        return method.decode("ascii"), target.decode("ascii"), headers, length, close

    def _feed_body(self) -> None:
        take = min(self._body_left, len(self._buffer))
        chunk = bytes(self._buffer[:take])
        del self._buffer[:take]
        self._body_left -= take
        if self._lent is not None:
            self._lent.data_received(chunk)
            return
        incoming = self._incoming
        assert incoming is not None
        if chunk:
            incoming.content.feed(chunk)
        if not self._body_left:
            incoming.content.end()

    def _answered(self, task: asyncio.Task[None]) -> None:
        """The call's answer is written: the next request, or the end of the connection."""
        incoming = self._incoming
        self._calling = self._incoming = None
        self._now_idle()
        if self._transport is None:
            self._register(self, None)
            return
        if (
            self._closing
            or incoming is None
            or incoming.must_close
            or self._body_left  # a body left unread: its bytes are no request
            or task.cancelled()
            or task.exception() is not None
        ):
            self._close()
            return
        if self._reading_paused:
            self._resume_reading()
        self._next()

    def _answer_shed(self, answer: bytes, incoming: Incoming) -> None:
        """A shed call, answered from its head at once; the connection is not read again for
        the Retry-After second it was told (gateway.server.overload)."""
        assert self._transport is not None
        self._incoming = None
        self._transport.write(answer)
        if incoming.must_close or self._body_left:
            self._close()
            return
        self._pause_reading()
        if self._shed_pause is not None:
            self._shed_pause.cancel()
        self._shed_pause = self._loop.call_later(
            self._dispatch.retry_after_s, self._resume_after_shed
        )

    def _resume_after_shed(self) -> None:
        self._shed_pause = None
        if self._transport is None:
            return
        self._resume_reading()
        if self._calling is None:
            self._next()

    def _lend(self, head_end: int, length: int | None) -> None:
        """One request for aiohttp's protocol to answer: its head and body, exactly, and the
        transport while it answers. It gives the connection back (`returned`) once it has
        answered and would keep the connection open; else it closes it."""
        assert self._transport is not None
        self._cancel_timer()
        self._lent = lent = self._dispatch.aiohttp_protocol(self._returned)
        lent.connection_made(self._transport)
        if self.writing_paused:
            lent.pause_writing()
        take = head_end + min(length or 0, len(self._buffer) - head_end)
        self._body_left = (length or 0) - (take - head_end)
        data = bytes(self._buffer[:take])
        del self._buffer[:take]
        lent.data_received(data)

    def _returned(self) -> None:
        """aiohttp's protocol has answered the request lent to it and let go of the
        transport: the connection is the front's again."""
        self._lent = None
        self._now_idle()
        if self._transport is None:
            return
        if self._closing or self._body_left:
            self._close()
            return
        self._reading_paused = False  # paused here while lent, or by aiohttp's protocol
        self._transport.resume_reading()
        self._next()

    def _now_idle(self) -> None:
        idle, self._idle = self._idle, None
        if idle is not None and not idle.done():
            idle.set_result(None)

    def _hand_over(self) -> None:
        """aiohttp's from now on: the transport, and the bytes from this request's first."""
        transport = self._transport
        if transport is None:
            return
        self._cancel_timer()
        if self._shed_pause is not None:
            self._shed_pause.cancel()
            self._shed_pause = None
        self._register(self, None)
        self._transport = None
        handler = self._dispatch.aiohttp_protocol()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self.writing_paused:
            handler.pause_writing()
        if self._reading_paused:
            transport.resume_reading()
        data, self._buffer = bytes(self._buffer), bytearray()
        handler.data_received(data)

    # -- timers and reading --------------------------------------------------------------------

    def _set_timer(self, delay: float, *, keepalive: bool = False) -> None:
        self._cancel_timer()
        self._keepalive_timer = keepalive
        self._timer = self._loop.call_later(delay, self._late)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self) -> None:
        """No whole head within the header timeout, or idle past the keep-alive one."""
        self._timer = None
        if self._calling is None and self._lent is None:
            self._close()

    def _pause_reading(self) -> None:
        if self._transport is not None and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._transport is not None and self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()

    def _wake_writer(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _close(self) -> None:
        self._cancel_timer()
        if self._shed_pause is not None:
            # a shed call's pause ends in no next request: the connection is closing (it
            # stays open until what was written is, and the pause may end before that)
            self._shed_pause.cancel()
        if self._transport is not None:
            self._transport.close()
