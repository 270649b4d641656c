"""The edges of the HTTP server that aiohttp does not expose as settings (docs/contract.md §5):

* a connection that sends no complete request head within `GATEWAY_HEADER_TIMEOUT_S` is
  closed (aiohttp only has an idle keep-alive timeout, which a slow head resets), and on an
  HTTPS gateway one whose TLS handshake takes longer than that too (asyncio allows a minute,
  and aiohttp's site passes on no other bound);
* requests the HTTP parser refuses are answered with problem+json, oversized heads `431`;
* request targets are refused `400` alike on aiohttp's C parser and its pure-Python one: a
  target with characters outside ASCII (the C parser refuses it, the Python one passed it on
  to the tool), and an absolute-form or CONNECT target whose host does not decode
  (`http://xn--a/`, on either parser: building the request from it fails inside aiohttp's
  connection task, which then neither answers nor closes the connection);
* so is a request with a header to pass on to the tool whose value has bytes that are not
  UTF-8: aiohttp's client cannot send it as received (its C writer drops those bytes, its
  Python writer fails after the connection was taken). The headers the gateway reads itself
  are left to their own checks (docs/contract.md §3).

aiohttp builds its protocol objects inside `web.Server`, with no hook; `GatewayRunner` swaps
the class of the server it made for a subclass that builds ours, and `GatewaySite` opens its
listening socket as aiohttp's `TCPSite` does, with the handshake bound. It is the one place
that leans on aiohttp internals beyond public settings, and tests pin its behaviour.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, InvalidURLError, LineTooLong
from aiohttp.web_protocol import RequestHandler, _ErrInfo

from gateway.core import errors
from gateway.proxy.headers import (
    GATEWAY_OWNED,
    HOP_BY_HOP,
    IDEMPOTENCY_HEADER,
    REQUEST_ID_HEADER,
)
from gateway.server.middleware import problem_response

# Headers never passed on as the client sent them: the gateway reads, replaces or drops them
# (GATEWAY_OWNED holds the fencing headers).
_NOT_PASSED_ON = (
    HOP_BY_HOP | GATEWAY_OWNED | {IDEMPOTENCY_HEADER.lower(), REQUEST_ID_HEADER.lower()}
)


def _not_utf8(headers: Any) -> str | None:
    """The first header to pass on whose value has bytes that are not UTF-8 (the parsers
    keep them as surrogates), or None."""
    for name, value in headers.items():
        if not value.isascii() and name.lower() not in _NOT_PASSED_ON:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return str(name)
    return None


class _GatewayRequestHandler(RequestHandler):
    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        heads, queued = self._request_count, len(self._messages)
        super().data_received(data)
        self._refuse_unforwardable(queued)
        if self._request_count > heads:
            self._cancel_head_timer()  # a whole head arrived
        elif self._current_request is None and not self._messages:
            self._start_head_timer()  # bytes of a new head: it has a deadline

    def _refuse_unforwardable(self, first: int) -> None:
        """Turn each request queued from `first` on that the module's docstring says is
        refused into the parser error it should have been."""
        for at in range(first, len(self._messages)):
            message, payload = self._messages[at]
            if isinstance(message, _ErrInfo):
                continue  # a parser error already
            target, url = message.path, message.url
            refusal: BadHttpMessage | None = None
            if not target.isascii():
                refusal = InvalidURLError(f"the request target {target[:100]!r} is not ASCII")
            elif url.absolute:
                try:
                    url.host  # noqa: B018 - what building the request reads, and may fail on
                except ValueError:
                    refusal = InvalidURLError(f"the host of {target[:100]!r} is not valid")
            if refusal is None and not target.startswith("/_gateway/"):
                name = _not_utf8(message.headers)
                if name is not None:
                    refusal = BadHttpMessage(f"header {name} has bytes that are not UTF-8")
            if refusal is not None:
                self._messages[at] = (_ErrInfo(400, refusal, refusal.message), payload)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _start_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self._loop.call_later(self.header_timeout_s, self._head_late)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._current_request is None and not self._messages and self.transport is not None:
            self.force_close()  # closes the transport, and lets go of it

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status == 500 or not isinstance(exc, BadHttpMessage):
            return super().handle_error(request, status, exc, message)
        error: errors.GatewayError = (
            errors.HeadersTooLarge("the request head is too large")
            if isinstance(exc, LineTooLong) or "Too many headers" in str(exc)
            else errors.InvalidRequest(f"the request is malformed: {exc.message.splitlines()[0]}")
        )
        response = problem_response(error, None)
        response.force_close()
        return response


class GatewayRunner(web.AppRunner):
    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        # cast: type() returns a plain `type`, but one made with _GatewayRequestHandler as its
        # only base is a subclass of it.
        self._handler_class = cast(
            type[_GatewayRequestHandler],
            type(
                "GatewayRequestHandler",
                (_GatewayRequestHandler,),
                {"header_timeout_s": header_timeout_s},
            ),
        )

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        handler_class = self._handler_class

        class GatewayServer(web.Server):
            def __call__(self) -> RequestHandler:
                return handler_class(self, loop=self._loop, **self._kwargs)

        server.__class__ = GatewayServer
        return server


class GatewaySite(web.TCPSite):
    """aiohttp's TCPSite, whose TLS handshakes must end within `handshake_timeout_s`."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        handshake_timeout_s: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(runner, host, port, **kwargs)
        self._handshake_timeout_s = handshake_timeout_s

    async def start(self) -> None:
        if self._ssl_context is None:
            return await super().start()
        await web.BaseSite.start(self)  # registers the site with its runner, as TCPSite does
        server = self._runner.server
        if server is None:
            raise RuntimeError("the runner is not set up")
        self._server = await asyncio.get_running_loop().create_server(
            server,
            self._host,
            self._port,
            ssl=self._ssl_context,
            ssl_handshake_timeout=self._handshake_timeout_s,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]
