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
  UTF-8: it cannot be sent to the tool as received (the gateway's client refuses it, and
  aiohttp's, for a session's handshake, would drop those bytes or fail after the connection
  was taken), so the caller is told at once, before anything is admitted. The headers the
  gateway reads itself are left to their own checks (docs/contract.md §3);
* `GATEWAY_MAX_INFLIGHT` (gateway.server.overload) is applied to each request as its head is
  parsed, before aiohttp builds a request object or a task for it. A shed call with nothing
  ahead of it on its connection and its body all in (a crowd's every call) is answered there
  and then, and its connection is not read again for the Retry-After second it was told;
  any other (pipelined behind another call, its body still coming, HTTP/1.0, an upgrade) is
  answered in its turn through aiohttp, which reads and drops its body, and its connection,
  when kept and its body all read, is left unread for that second too. A counted call's
  time runs from the parse of its head to the end of the writing of its answer.

Every connection starts on the front (gateway.wire.front; its calls are served by
gateway.server.front), which applies the same rules to the requests it serves. The requests
it lends to aiohttp's protocol, and those on a connection it handed over, come out of
aiohttp's parser, which `_AdmittingParser` wraps so that each goes through the checks above
before aiohttp queues it; a lent protocol gives the connection back (`_give_back`) once it
has answered its one request and read all of its body. aiohttp builds its protocol objects
inside `web.Server`, with no hook; `GatewayRunner` swaps the class of the server it made for
`GatewayServer`, which builds the front and, for it, ours, and `GatewaySite` opens its
listening socket as aiohttp's `TCPSite` does, with the TLS handshake bound. It is the one
place that leans on aiohttp internals beyond public settings (the parser's queue, the
protocol's request loop, its read pausing, letting go of a transport), and tests pin its
behaviour on the newest aiohttp and the oldest allowed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from aiohttp import web
from aiohttp.http import HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import BadHttpMessage, InvalidURLError, LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler, _ErrInfo, _MsgType
from aiohttp.web_request import BaseRequest

from gateway.core import errors
from gateway.proxy import appkeys
from gateway.proxy.headers import (
    GATEWAY_OWNED,
    HOP_BY_HOP,
    IDEMPOTENCY_HEADER,
    REQUEST_ID_HEADER,
)
from gateway.proxy.slot import Slot
from gateway.server import overload
from gateway.server.front import FrontDispatch
from gateway.server.middleware import problem_response
from gateway.server.overload import LIMIT, InflightLimit, ShedAnswer
from gateway.wire.front import Front

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


def _refusal(message: RawRequestMessage) -> BadHttpMessage | None:
    """The parser error a request the module's docstring refuses should have been, or None."""
    target, url = message.path, message.url
    if not target.isascii():
        return InvalidURLError(f"the request target {target[:100]!r} is not ASCII")
    if url.absolute:
        try:
            url.host  # noqa: B018 - what building the request reads, and may fail on
        except ValueError:
            return InvalidURLError(f"the host of {target[:100]!r} is not valid")
    if not target.startswith("/_gateway/"):
        name = _not_utf8(message.headers)
        if name is not None:
            return BadHttpMessage(f"header {name} has bytes that are not UTF-8")
    return None


def _answering(answer: ShedAnswer) -> Callable[[BaseRequest], Awaitable[web.StreamResponse]]:
    """A handler in place of the app's, for a shed call answered in its turn on the connection
    (aiohttp then reads and drops its body, and keeps the connection if the client does)."""

    async def handler(request: BaseRequest) -> web.StreamResponse:
        return web.Response(status=503, body=answer.body, headers=dict(answer.headers))

    return handler


class _AdmittingParser:
    """aiohttp's request parser, every request it parses taken through its connection's
    `_take` before aiohttp queues it: the one source of requests on a connection, the bytes
    behind a declined upgrade (which aiohttp parses in `finish_response`) included."""

    __slots__ = ("_parser", "_take")

    def __init__(
        self, parser: Any, take: Callable[[Sequence[_MsgType], bool], list[_MsgType]]
    ) -> None:
        self._parser = parser
        self._take = take

    def feed_data(self, data: bytes) -> tuple[Sequence[_MsgType], bool, bytes]:
        messages, upgraded, tail = self._parser.feed_data(data)
        return (self._take(messages, upgraded) if messages else messages), upgraded, tail

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


class _GatewayRequestHandler(RequestHandler):
    header_timeout_s = 10.0
    inflight: InflightLimit
    # set when the front lent this protocol one request (gateway.wire.front): called once it
    # has answered it and let go of the transport, the connection kept
    lender: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        self._shed_pause: asyncio.TimerHandle | None = None
        # the requests parsed and queued here that GATEWAY_MAX_INFLIGHT counted (with the time
        # their head arrived) or shed (with their answer), by id: aiohttp's request object
        # keeps the parsed message it was made from
        self._verdicts: dict[int, tuple[RawRequestMessage, float | ShedAnswer]] = {}
        self._parser = cast(Any, _AdmittingParser(self._parser, self._take))
        super().connection_made(transport)
        self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        super().data_received(data)
        if self._request_count > heads:
            self._cancel_head_timer()  # a whole head arrived
        elif data and self._current_request is None and not self._messages:
            self._start_head_timer()  # bytes of a new head: it has a deadline (aiohttp
            # feeds b"" to reparse what its parser holds, which is not a new head)

    def _take(self, messages: Sequence[_MsgType], upgraded: bool) -> list[_MsgType]:
        """The requests just parsed, as aiohttp is to queue them: those the module's docstring
        refuses turned into the parser errors they should have been, and GATEWAY_MAX_INFLIGHT
        applied to the others (gateway.server.overload). A shed call with nothing ahead of it
        on the connection is answered here and left out: no request object, no task. `upgraded`:
        the parser took what follows the last of them for another protocol (an upgrade, or
        CONNECT), which aiohttp undoes only once it has answered that request itself."""
        now = self._loop.time()
        taken: list[_MsgType] = []
        for message, payload in messages:
            if isinstance(message, _ErrInfo):
                taken.append((message, payload))
                continue
            refusal = _refusal(message)
            if refusal is not None:
                taken.append((_ErrInfo(400, refusal, refusal.message), payload))
                continue
            verdict = self.inflight.admit(
                message.method, message.path, message.url.path, message.headers, now
            )
            if (
                isinstance(verdict, ShedAnswer)
                and not upgraded
                and self._can_answer_now(messages, message, payload)
            ):
                self._answer_now(verdict, message)
                continue
            if verdict is not False:  # answered in turn, when aiohttp has made its request
                self._verdicts[id(message)] = (message, now if verdict is True else verdict)
            taken.append((message, payload))
        return taken

    def _can_answer_now(
        self, messages: Sequence[_MsgType], message: RawRequestMessage, payload: StreamReader
    ) -> bool:
        """Whether a shed call can be answered before aiohttp sees it: it is the only request
        read, nothing is being answered on the connection nor queued (aiohttp's loop waits for
        a request), its body is all in (so the next request's bytes are where the parser
        expects them), it is HTTP/1.1, and the client reads its answers (its writes are not
        paused)."""
        waiter = self._waiter
        return (
            len(messages) == 1
            and waiter is not None
            and not waiter.done()
            and not self._messages
            and payload.is_eof()
            and message.version == HttpVersion11
            and not self.writing_paused
            and self.transport is not None
        )

    def _answer_now(self, answer: ShedAnswer, message: RawRequestMessage) -> None:
        assert self.transport is not None and self._parser is not None
        # Taken, as far as the parser knows: it hands over no more requests while 32 it
        # handed over are not, and this one never reaches aiohttp's queue.
        self._parser.message_consumed()
        close = message.should_close
        self.transport.write(answer.wire(close=close, to_head=message.method == "HEAD"))
        self._request_count += 1  # a request handled: its head timer is done
        if close:
            self.force_close()  # the client asked: the answer is flushed first
            return
        self._next_keepalive_close_time = self._loop.time() + self._keepalive_timeout
        self._pause_after_shed()

    def _pause_after_shed(self) -> None:
        """Not read again before the Retry-After the client was told: one that resends at once
        on this connection (a retry loop, wrk) waits that out unread, costing the loop nothing,
        instead of cycling through 503s as fast as the loop answers them. The second counts
        from the last 503, and the pause is made again: aiohttp resumes reading when it takes
        a pipelined request from its queue."""
        if self._shed_pause is not None:
            self._shed_pause.cancel()
        self._pause_reading_for_buffer()
        self._shed_pause = self._loop.call_later(overload.RETRY_AFTER_S, self._resume_after_shed)

    def _resume_after_shed(self) -> None:
        self._shed_pause = None
        # as aiohttp resumes once its queue has drained: the requests its parser holds are
        # parsed first, and reading stays paused while its queue is still full
        self._resume_reading_if_drained()

    async def _handle_request(
        self,
        request: BaseRequest,
        start_time: float | None,
        request_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        verdict = self._verdicts.pop(id(request._message), (None, None))[1]
        if isinstance(verdict, ShedAnswer):
            answered = await super()._handle_request(request, start_time, _answering(verdict))
            # its body all read (aiohttp would wait for the rest of one unread, which the
            # pause would hold back) and the connection kept: paused as one answered at once
            if request.content.is_eof() and answered[0].keep_alive and not answered[1]:
                self._pause_after_shed()
            return answered
        slot = None
        if verdict is not None:  # a counted call
            slot = request[appkeys.SLOT] = Slot(self.inflight.done, verdict)
        try:
            answered = await super()._handle_request(request, start_time, request_handler)
        finally:
            if slot is not None:  # now answered, unless its slot was given back before
                flow = request.get(appkeys.FLOW)
                slot.release(flow.upstream_s if flow is not None else 0.0, self._loop.time())
        response, reset = answered
        if self.lender is not None and not reset and response.keep_alive:
            # once its whole body is in (aiohttp reads what is left of one the handler did
            # not), the next request starts where the front says
            request.content.on_eof(self._give_back_soon)
        return answered

    def _give_back_soon(self) -> None:
        self._loop.call_soon(self._give_back)  # once aiohttp's request loop is past it

    def _give_back(self) -> None:
        """The lent request is answered: let go of the transport without closing it (the
        front reads the connection on) and end this protocol's request loop."""
        lender, self.lender = self.lender, None
        if lender is None or self.transport is None or self._messages:
            return  # closed meanwhile, or not at a request boundary: aiohttp's to end
        if self._force_close or self._close:
            return
        self._cancel_head_timer()
        if self._shed_pause is not None:
            self._shed_pause.cancel()
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None
        if self._manager is not None:
            self._manager.connection_lost(self, None)
        self.transport = None  # so that force_close closes nothing
        self.force_close()
        lender()

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """aiohttp's drain, bounded by `timeout` in all: aiohttp waits that long for the
        request in progress, then cancels it and waits as long again."""
        try:
            await asyncio.wait_for(super().shutdown(timeout), timeout)
        except TimeoutError:
            if self._task_handler is not None:
                self._task_handler.cancel()
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        if self._shed_pause is not None:
            self._shed_pause.cancel()
        for message, _ in self._messages:  # queued, and never to be handled now
            counted = self._verdicts.pop(id(message), (None, None))[1]
            if isinstance(counted, float):
                self.inflight.abandoned()
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
                {"header_timeout_s": header_timeout_s, "inflight": app[LIMIT]},
            ),
        )

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = GatewayServer
        gateway_server = cast(GatewayServer, server)
        gateway_server.handler_class = self._handler_class
        gateway_server.keepalive_timeout_s = float(server._kwargs.get("keepalive_timeout", 75))
        gateway_server.front = FrontDispatch(self.app, gateway_server.aiohttp_protocol)
        return server


class GatewayServer(web.Server):
    """Every connection starts on the front (gateway.wire.front), which hands the ones it
    does not serve to aiohttp's protocol, ours (`_GatewayRequestHandler`). Made by
    `GatewayRunner`, which sets what follows."""

    front: FrontDispatch
    handler_class: type[_GatewayRequestHandler]
    keepalive_timeout_s: float

    def aiohttp_protocol(self, returned: Callable[[], None] | None = None) -> RequestHandler:
        handler = self.handler_class(self, loop=self._loop, **self._kwargs)
        handler.lender = returned
        return handler

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]
        return Front(
            self.front,
            self._register,
            header_timeout_s=self.handler_class.header_timeout_s,
            keepalive_timeout_s=self.keepalive_timeout_s,
            backlog=self.front.backlog,
        )

    def _register(self, front: Front, transport: asyncio.Transport | None) -> None:
        """The server's list of connections, which it closes, then drains, at shutdown."""
        connections = cast(dict[Any, asyncio.Transport], self._connections)
        if transport is None:
            connections.pop(front, None)
        else:
            connections[front] = transport


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
