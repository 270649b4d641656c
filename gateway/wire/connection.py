"""One connection to an upstream, as an asyncio protocol: idle in its pool, or carrying one
exchange (a request written once, its answer read).

Like httpcore's, a connection is handed out only when idle and is reusable only after its
answer ended cleanly (`Answer.clean`), its request was written out whole, and the tool has
neither closed its side nor sent a byte since. Anything that arrives on an idle connection is
an answer to nothing: the connection is dropped, so those bytes can never be read as the
answer of the next call.
"""

from __future__ import annotations

import asyncio
import fcntl
import select
import ssl
import sys
import termios
from collections.abc import Sequence
from typing import Protocol, cast

from gateway.wire.answer import Answer
from gateway.wire.errors import HandshakeRefused

# an end the tool did not signal: no FIN, or over TLS no close_notify before it
_TRUNCATED = ConnectionResetError("the connection ended without the tool ending it")


class Owner(Protocol):
    """Where a connection goes when its exchange is over (its pool)."""

    def release(self, connection: Connection, reusable: bool) -> None: ...

    def forget(self, connection: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """A socket to the tool, and the one answer it is reading, if any."""

    def __init__(self, owner: Owner) -> None:
        self._owner = owner
        self._transport: asyncio.Transport | None = None
        self._answer: Answer | None = None
        self._closed = False  # connection_lost was called
        self._peer_done = False  # the tool closed its side (EOF)
        self._writing_paused = False
        self._reading_paused = False
        self.idle_since = 0.0
        self._fresh = True  # no exchange has ended on it yet: its handshake may yet be refused
        self._pending = select.poll()  # its socket, once made: what `quiet` asks
        self.loop: asyncio.AbstractEventLoop  # set when the connection is made

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream transport, TCP or TLS
        # its answers' waits make their futures here: asking asyncio for the running loop
        # makes a getpid() system call each time
        self.loop = asyncio.get_running_loop()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._pending.register(sock.fileno(), select.POLLIN | select.POLLPRI)

    def data_received(self, data: bytes) -> None:
        answer = self._answer
        if answer is None:  # on an idle connection: an answer to nothing
            self.abort()
            return
        answer.feed(data)
        if answer.spoiled:
            self.abort()

    def eof_received(self) -> bool:
        self._peer_done = True
        if self._answer is not None:
            self._answer.connection_ended(None if self._ended_cleanly() else _TRUNCATED)
        return False  # close our side too

    def _ended_cleanly(self) -> bool:
        """Over TLS, whether the end came with the tool's close_notify: a bare TCP FIN
        (asyncio's and uvloop's TLS transports report it as an end all the same) may have
        cut what ends at the close. After close_notify a read says so (b"" or
        SSLZeroReturnError); without it, there is nothing to read yet (SSLWantReadError)."""
        transport = self._transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        if ssl_object is None:
            return True
        try:
            rest: bytes = ssl_object.read(1)
        except ssl.SSLZeroReturnError:
            return True
        except (ssl.SSLError, OSError, ValueError):
            return False
        return rest == b""

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._answer is not None:
            if exc is None and not self._peer_done:
                # no end from the tool came first: uvloop's TLS transport ends this way on
                # a bare TCP FIN, without close_notify (asyncio's calls eof_received)
                exc = _TRUNCATED
            if self._fresh and not self._answer.heard and _handshake_alert(exc):
                self._answer.refused(HandshakeRefused(f"the tool refused the TLS handshake: {exc}"))
            self._answer.connection_ended(exc)
        self._owner.forget(self)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False

    # -- what the pool and the answer ask ----------------------------------------------------

    @property
    def usable(self) -> bool:
        """Open both ways, as far as this process can tell without writing to it."""
        transport = self._transport
        return (
            transport is not None
            and not self._closed
            and not self._peer_done
            and not transport.is_closing()
        )

    @property
    def quiet(self) -> bool:
        """Nothing waits in the socket that the loop has not read yet: no byte, no close.
        A busy loop may not have read what the tool sent an idle connection when it is taken
        again; found only after the next call is written, those bytes would be read as its
        answer, and a close would break it (outcome unknown, for a call the tool never saw)."""
        return not self._pending.poll(0)

    def start(self, answer: Answer, payload: Sequence[bytes]) -> None:
        """Write the whole request in one call, and read `answer` from here on."""
        transport = self._transport
        if transport is None:
            raise RuntimeError("start() before the connection was made")
        self._answer = answer
        transport.writelines(payload)

    def finish(self, answer: Answer) -> None:
        """The exchange is over: reusable only when it ended cleanly and nothing of the
        request is left to write (a tool that answered before reading the whole body)."""
        self._answer = None
        self._fresh = False
        transport = self._transport
        reusable = (
            answer.clean
            and self.usable
            and transport is not None
            and not self._writing_paused
            and transport.get_write_buffer_size() == 0
            and _tls_all_sent(transport)
        )
        if reusable:
            self.resume_reading()
        self._owner.release(self, reusable)

    def pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None and not self._closed:
            self._reading_paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        """Close once what was written has gone out (a withdrawn call wrote nothing)."""
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Close at once, dropping whatever is buffered either way. An answer still coming
        is broken, not ended: a body that runs until the close must not look whole."""
        if self._answer is not None:
            self._answer.connection_ended(ConnectionAbortedError("closed by the gateway"))
        if self._transport is not None:
            self._transport.abort()


def _tls_all_sent(transport: asyncio.Transport) -> bool:
    """Over TLS, whether the tool's host has every byte written: asyncio's and uvloop's TLS
    transports count in their write buffer size only what is not yet encrypted, not what the
    TCP transport under them still holds (a body the tool stopped reading when it answered
    early). The socket's send queue (bytes the peer has not acknowledged) says it for both;
    an answer sent after the whole request was read acknowledges all of it."""
    if transport.get_extra_info("ssl_object") is None:
        return True  # plain TCP: its write buffer size is the whole of it
    sock = transport.get_extra_info("socket")
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (AttributeError, OSError, ValueError):
        return False
    return int.from_bytes(queued, sys.byteorder) == 0


# The alerts a TLS server sends when it refuses the client's side of the handshake (its
# certificate, or the handshake as a whole): sent before it reads any application data.
_REFUSALS = (
    "ALERT_CERTIFICATE_REQUIRED",
    "ALERT_UNKNOWN_CA",
    "ALERT_BAD_CERTIFICATE",
    "ALERT_CERTIFICATE_EXPIRED",
    "ALERT_CERTIFICATE_REVOKED",
    "ALERT_CERTIFICATE_UNKNOWN",
    "ALERT_UNSUPPORTED_CERTIFICATE",
    "ALERT_ACCESS_DENIED",
    "ALERT_HANDSHAKE_FAILURE",
    "ALERT_DECRYPT_ERROR",
)


def _handshake_alert(exc: BaseException | None) -> bool:
    reason = getattr(exc, "reason", None) if isinstance(exc, ssl.SSLError) else None
    return isinstance(reason, str) and reason.endswith(_REFUSALS)
