"""The keep-alive connections to one upstream, and the one way a request is sent on them.

`send` takes a connection (an idle one, or a new one while fewer than `limit` are open, or
waits for one to come free), asks the caller's last check, writes the whole request in one
call and waits for the answer's head. Between the check and the write nothing else runs: no
`await`, no task of its own writing later, so a process that was paused, or whose loop fell
behind, cannot have its check answered long before its bytes leave.

Exactly once: nothing is ever sent again. Before the write, a connection found closed by the
tool while idle is dropped and another taken: nothing of the request has left. After the
write, whatever happens is `MaybeSent`: a tool that closed an idle connection just as the
request went out may have read it.

Idle connections are reused last-in first-out (the most recently used is the likeliest to be
open still) and closed after `KEEPALIVE_S` unused, as aiohttp's client did.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable

from multidict import CIMultiDict

from gateway.wire.answer import Answer
from gateway.wire.connection import Connection
from gateway.wire.errors import ConnectError, ReadTimeout, Withdrawn
from gateway.wire.request import encode_head

KEEPALIVE_S = 15.0


class Pool:
    """Up to `limit` connections to `host`:`port`, over TLS when `tls` is given."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        limit: int,
        connect_timeout_s: float,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> None:
        self._host, self._port = host, port
        self._limit = limit
        # the event loop it serves, once it first runs there: asking asyncio for the running
        # loop makes a getpid() system call each time, which is a call's every step here
        self._running: asyncio.AbstractEventLoop | None = None
        self._connect_timeout_s = connect_timeout_s
        self._tls = tls
        self._server_hostname = server_hostname if tls is not None else None
        self._open: set[Connection] = set()  # every connection holding a slot
        self._idle: list[Connection] = []  # the reusable ones, most recent last
        self._waiters: deque[asyncio.Future[Connection | None]] = deque()
        self._expiry: asyncio.TimerHandle | None = None
        self._closed = False

    async def send(
        self,
        method: str,
        target: str,
        headers: CIMultiDict[str],
        body: bytes | None,
        deadline: float,
        may_send: Callable[[], bool] | None = None,
    ) -> Answer:
        """Send the request once and return its answer with the head read (loop time
        `deadline` bounds it all); raise a `WireError` that says whether it may have left.

        `may_send`, asked once a connection is in hand and nothing is written, is the
        caller's last word: False, and nothing is sent (`Withdrawn`)."""
        head = encode_head(method, target, headers.items(), body)
        connection = await self._acquire(deadline)
        # no await from here to the write: the check is answered at the moment of the write
        if may_send is not None and not may_send():
            connection.close()
            self.forget(connection)
            raise Withdrawn("the last check before the write said no")
        answer = Answer(connection, head_only=method == "HEAD")
        connection.start(answer, (head, body) if body else (head,))
        # from here on the tool may have the request: nothing is ever sent again
        try:
            await answer.wait_head(deadline)
        except TimeoutError:
            answer.release()
            raise ReadTimeout("no answer by the deadline") from None
        except BaseException:  # BrokenAnswer, or the call was cancelled
            answer.release()
            raise
        return answer

    # -- connections -------------------------------------------------------------------------

    def _loop(self) -> asyncio.AbstractEventLoop:
        if self._running is None:
            self._running = asyncio.get_running_loop()
        return self._running

    async def _acquire(self, deadline: float) -> Connection:
        """An open connection: an idle one, a new one, or the next to come free, within the
        connect timeout (which, as in aiohttp's client, counts the wait for a free slot too).
        Returns without an `await` after its last look at the connection."""
        loop = self._loop()
        if loop.time() >= deadline:  # an idle connection would be taken without a wait
            raise ConnectError("the call's deadline passed before it could be sent")
        budget = min(deadline, loop.time() + self._connect_timeout_s)
        while True:
            if self._closed:  # the app is shutting down (a waiter is woken by `close`)
                raise ConnectError("the pool is closed")
            connection = self._take_idle(loop.time())
            if connection is not None:
                return connection
            if len(self._open) < self._limit:
                connection = await self._connect(budget)
                if not connection.usable:  # the tool closed it at once
                    self.release(connection, reusable=False)
                    raise ConnectError("the tool closed the connection before any request")
                return connection
            waiter: asyncio.Future[Connection | None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(budget):
                    handed = await waiter
            except BaseException as exc:
                given = waiter.result() if waiter.done() and not waiter.cancelled() else None
                if given is not None:  # handed over just as the wait ended: pass it on
                    self.release(given, reusable=True)
                if isinstance(exc, TimeoutError):
                    raise ConnectError(
                        f"all {self._limit} connections stayed busy for {self._connect_timeout_s}s"
                    ) from None
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if handed is not None and handed.usable and handed.quiet:
                return handed
            if handed is not None:  # closed by the tool on its way here: nothing was sent
                self.release(handed, reusable=False)
            # a slot came free: take an idle connection or open one

    def _take_idle(self, now: float) -> Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable and now - connection.idle_since < KEEPALIVE_S and connection.quiet:
                return connection
            connection.abort()  # closed by the tool while idle, bytes from it, or idle too long
            self.forget(connection)
        return None

    async def _connect(self, budget: float) -> Connection:
        connection = Connection(self)
        self._open.add(connection)
        try:
            async with asyncio.timeout_at(budget):
                await asyncio.get_running_loop().create_connection(
                    lambda: connection,
                    self._host,
                    self._port,
                    ssl=self._tls,
                    server_hostname=self._server_hostname,
                )
        except BaseException as exc:
            self.forget(connection)
            if isinstance(exc, TimeoutError):
                raise ConnectError(f"no connection within {self._connect_timeout_s}s") from None
            if isinstance(exc, OSError):  # refused, no such host, TLS handshake
                raise ConnectError(f"{type(exc).__name__}: {exc}") from exc
            raise
        return connection

    # -- the connections' Owner --------------------------------------------------------------

    def release(self, connection: Connection, reusable: bool) -> None:
        """An exchange is over: hand the connection to a waiter, keep it idle, or close it."""
        if not reusable or self._closed:
            connection.abort()
            self.forget(connection)
            return
        loop = self._loop()
        connection.idle_since = loop.time()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        self._idle.append(connection)
        if self._expiry is None:
            self._expiry = loop.call_later(KEEPALIVE_S, self._expire)

    def forget(self, connection: Connection) -> None:
        """The connection is gone (or going): its slot is free for a waiter."""
        if connection not in self._open:
            return
        self._open.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _expire(self) -> None:
        """Close the connections idle for `KEEPALIVE_S`; look again when the next one is."""
        self._expiry = None
        now = self._loop().time()
        for connection in [c for c in self._idle if now - c.idle_since >= KEEPALIVE_S]:
            connection.close()
            self.forget(connection)
        if self._idle:
            oldest = min(c.idle_since for c in self._idle)
            self._expiry = self._loop().call_later(oldest + KEEPALIVE_S - now, self._expire)

    async def close(self) -> None:
        """Close every connection; the pool takes no more calls."""
        self._closed = True
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        for connection in list(self._open):
            connection.abort()
            self.forget(connection)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
