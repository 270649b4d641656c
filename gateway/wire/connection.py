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
from collections.abc import Sequence
from typing import Protocol, cast

from gateway.wire.answer import Answer


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
        self.loop: asyncio.AbstractEventLoop  # set when the connection is made

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream transport, TCP or TLS
        # its answers' waits make their futures here: asking asyncio for the running loop
        # makes a getpid() system call each time
        self.loop = asyncio.get_running_loop()

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
            self._answer.connection_ended(None)
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._answer is not None:
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
        transport = self._transport
        reusable = (
            answer.clean
            and self.usable
            and transport is not None
            and not self._writing_paused
            and transport.get_write_buffer_size() == 0
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
