"""`GATEWAY_MAX_INFLIGHT` (docs/contract.md §11): a limit on proxied calls in progress at once
in this process. One call more is answered `503 overloaded` with `Retry-After: 1` at once,
before its body is read, its fence looked at or anything admitted or forwarded: no receipt,
and the calls already taken keep a bounded latency instead of all slowing down together.

`auto` (the default) moves the limit with the latency calls see in the gateway itself
(gateway.core.concurrency): the time from the head's arrival to the answer, less the time the
tool took to answer, so that a slow tool does not read as an overloaded gateway (tools have
their own `max_connections`). A number fixes the limit.

`/_gateway/` paths are never counted nor refused here. A WebSocket upgrade is refused like a
call when the limit is reached, but an open session is not counted: it lasts as long as its
browser, and its length says nothing about how busy the process is.

The middleware runs first, ahead of the request id, authentication and the log line: a
shed call costs as little as the gateway can answer for, and is counted in
`fence_gateway_rejections_total{code="overloaded"}`; the log says how many were shed at most
once every `_LOG_EVERY_S`. An MCP client's POST is told in JSON-RPC, as every refusal of
the gateway's own to it is (its id is null: the body is never read).
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.core import errors
from gateway.core.concurrency import GradientLimit
from gateway.observe import logs
from gateway.proxy import appkeys, headers
from gateway.server.middleware import error_response

_LOG_EVERY_S = 10.0


class InflightLimit:
    """Calls in progress, and how many may be."""

    __slots__ = ("_adaptive", "_last_log", "_shed_since_log", "in_flight", "limit")

    def __init__(self, setting: int | str) -> None:
        self._adaptive = GradientLimit() if setting == "auto" else None
        self.limit = self._adaptive.current if self._adaptive is not None else int(setting)
        self.in_flight = 0
        self._shed_since_log = 0
        self._last_log = float("-inf")

    @property
    def adaptive(self) -> bool:
        return self._adaptive is not None

    def done(self, rtt_s: float, now: float) -> None:
        """A counted call finished after `rtt_s`."""
        if self._adaptive is not None:
            self.limit = self._adaptive.sample(rtt_s, self.in_flight, now)
        self.in_flight -= 1

    def shed(self, now: float) -> None:
        self._shed_since_log += 1
        if now - self._last_log >= _LOG_EVERY_S:
            logs.event(
                "overloaded",
                logging.WARNING,
                detail=f"{self._shed_since_log} calls answered 503 overloaded",
                limit=self.limit,
                adaptive=self.adaptive,
            )
            self._shed_since_log, self._last_log = 0, now


LIMIT = web.AppKey("inflight_limit", InflightLimit)


def install(app: web.Application, setting: int | str) -> None:
    app[LIMIT] = InflightLimit(setting)
    app.middlewares.insert(0, shed)


@web.middleware
async def shed(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith("/_gateway/"):
        return await handler(request)
    app = request.app
    limit = app[LIMIT]
    loop = asyncio.get_running_loop()
    if limit.in_flight >= limit.limit:
        limit.shed(loop.time())
        metrics = app[appkeys.METRICS]
        metrics.rejections_of("-", "overloaded").inc()
        metrics.requests_of("-", "rejected").inc()
        tracing = app[appkeys.TRACING]  # None, unless GATEWAY_OTEL (docs/contract.md §21)
        if tracing is not None:
            tracing.shed(request, errors.Overloaded.status)
        return error_response(
            request,
            errors.Overloaded(
                f"{limit.in_flight} calls are in progress, the most this gateway takes on "
                "at once; retry later",
                retry_after=1,
            ),
            headers.request_id(request.headers) or headers.new_request_id(),
        )
    if "Upgrade" in request.headers:
        return await handler(request)  # a session: not counted (the module's docstring)
    limit.in_flight += 1
    started = loop.time()
    try:
        return await handler(request)
    finally:
        # the gateway's own share: a slow tool is not this process being overloaded
        flow = request.get(appkeys.FLOW)
        now = loop.time()
        limit.done(now - started - (flow.upstream_s if flow is not None else 0.0), now)
