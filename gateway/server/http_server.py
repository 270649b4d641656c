"""The edges of the HTTP server that aiohttp does not expose as settings (docs/contract.md §5):

* a connection that sends no complete request head within `GATEWAY_HEADER_TIMEOUT_S` is
  closed (aiohttp only has an idle keep-alive timeout, which a slow head resets);
* requests the HTTP parser refuses are answered with problem+json, oversized heads `431`.

aiohttp builds its protocol objects inside `web.Server`, with no hook; `GatewayRunner` swaps
the class of the server it made for a subclass that builds ours. It is the one place that
leans on aiohttp internals beyond public settings, and tests pin its behaviour.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from gateway.core import errors
from gateway.server.middleware import problem_response


class _GatewayRequestHandler(RequestHandler):
    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        super().data_received(data)
        if self._request_count > heads:
            self._cancel_head_timer()  # a whole head arrived
        elif self._current_request is None and not self._messages:
            self._start_head_timer()  # bytes of a new head: it has a deadline

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
            self.force_close()
            self.transport.close()

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
