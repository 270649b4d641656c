"""`GATEWAY_MAX_INFLIGHT` (docs/contract.md §11): a limit on proxied calls in progress at once
in this process. One call more is answered `503 overloaded` with `Retry-After: 1` at once,
before its body is read, its fence looked at or anything admitted or forwarded: no receipt,
and the calls already taken keep a bounded latency instead of all slowing down together.

`auto` (the default) moves the limit with the latency calls see in the gateway itself
(gateway.core.concurrency): the time from the moment the server parsed the call's head to
the moment its answer was written, less the time the tool took to answer, so that a slow tool
does not read as an overloaded gateway (tools have their own `max_connections`). A number
fixes the limit.

`/_gateway/` paths are never counted nor refused here. A WebSocket upgrade is refused like a
call when the limit is reached, but an open session is not counted: it lasts as long as its
browser, and its length says nothing about how busy the process is. Nor is an unfenced MCP
answer once its head is written: it is the tool's stream from then on (gateway.proxy.slot).

The decision is made on the parsed head alone, by the HTTP server (gateway.server.
http_server) before aiohttp builds a request for it, and the connection of a shed call is not
read again before its Retry-After second is over: a shed call costs as little as the gateway
can answer for, and a crowd that resends at once when shed (a retry loop without backoff,
wrk) cannot take the event loop from the calls it admitted. Nor can a crowd that arrives at
once: while the process is full, heads wait in the server's backlog (gateway.wire.backlog)
and are answered a few per turn of the loop, each shed as it would have been when it came
(`waited`), even if a place has come free since. The answer is prepared here, once,
but for its request id (the client's, or a new one); it is counted in
`fence_gateway_rejections_total{code="overloaded"}` and the log says how many were shed at
most once every `_LOG_EVERY_S`. An MCP client's POST is told in JSON-RPC, as every refusal of
the gateway's own to it is (its id is null: the body is never read).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.config.policy import PolicySet
from gateway.core import errors
from gateway.core import mcp as jsonrpc
from gateway.core.concurrency import GradientLimit
from gateway.observe import logs
from gateway.observe.metrics import Metrics
from gateway.proxy import appkeys, headers
from gateway.server.middleware import PROBLEM_TYPE, problem_document
from gateway.wire.incoming import whole

_LOG_EVERY_S = 10.0
_DETAIL = "this gateway has as many calls in progress as it takes on at once; retry later"
RETRY_AFTER_S = 1
_PLACEHOLDER = "request-id-goes-here"


@dataclass(frozen=True, slots=True)
class ShedAnswer:
    """The `503 overloaded` of one call: its headers (Content-Length aside) and body."""

    headers: tuple[tuple[str, str], ...]
    body: bytes

    def wire(self, *, close: bool, to_head: bool) -> bytes:
        """As the server writes it, with the headers aiohttp would add (and no body after
        them when it answers a HEAD, which HTTP says has none)."""
        return whole(503, CIMultiDict(self.headers), self.body, close=close, to_head=to_head)


class _Prepared:
    """One refusal's body, split around its request id: only that differs between calls."""

    __slots__ = ("_after", "_before", "_content_type")

    def __init__(self, content_type: str, rendered: bytes) -> None:
        self._content_type = content_type
        self._before, self._after = rendered.split(json.dumps(_PLACEHOLDER).encode())

    def answer(self, request_id: str) -> ShedAnswer:
        return ShedAnswer(
            (
                ("Content-Type", self._content_type),
                ("Retry-After", str(RETRY_AFTER_S)),
                (headers.REQUEST_ID_HEADER, request_id),
            ),
            self._before + json.dumps(request_id).encode() + self._after,
        )


def _prepare() -> tuple[_Prepared, _Prepared]:
    """The problem+json answer, and the JSON-RPC one an MCP client's POST gets (docs/contract.md
    §5, §16), as the gateway's error responses render them."""
    document = problem_document(errors.Overloaded(_DETAIL, retry_after=RETRY_AFTER_S), _PLACEHOLDER)
    problem = _Prepared(f"{PROBLEM_TYPE}; charset=utf-8", json.dumps(document).encode())
    mcp = _Prepared("application/json", jsonrpc.error_response(None, document))
    return problem, mcp


class InflightLimit:
    """Calls in progress, how many may be, and the answer to one more."""

    __slots__ = (
        "_adaptive",
        "_app",
        "_last_log",
        "_metrics",
        "_policies",
        "_prepared",
        "_shed_since_log",
        "in_flight",
        "limit",
    )

    def __init__(self, setting: int | str, app: web.Application) -> None:
        self._adaptive = GradientLimit() if setting == "auto" else None
        self.limit = self._adaptive.current if self._adaptive is not None else int(setting)
        self.in_flight = 0
        self._app = app  # its tracing hook is set at startup, after the limit is installed
        self._policies: PolicySet = app[appkeys.POLICIES]
        self._prepared = _prepare()
        self._metrics: Metrics = app[appkeys.METRICS]
        self._shed_since_log = 0
        self._last_log = float("-inf")

    @property
    def adaptive(self) -> bool:
        return self._adaptive is not None

    def admit(
        self,
        method: str,
        target: str,
        path: str,
        fields: CIMultiDictProxy[str],
        now: float,
        waited: bool = False,
    ) -> ShedAnswer | bool:
        """The decision on a call whose head was just parsed (`target` as received, `path`
        its path percent-decoded, `fields` its headers): its answer when it is shed; True when
        it is counted, and `done` must follow once it is answered; False when it passes
        uncounted (the module's docstring). `waited`: the head came while the process was
        full and waited for its turn (gateway.wire.backlog): it is shed, as it was then."""
        if self.overloaded(path, waited=waited):
            return self._shed(method, target, fields, now)
        if path.startswith("/_gateway/") or "Upgrade" in fields:
            return False  # never counted; an upgrade opens a session, not counted either
        self.in_flight += 1
        return True

    def full(self) -> bool:
        """Whether a call now would be shed, its path aside."""
        return self.in_flight >= self.limit

    def overloaded(self, path: str, *, waited: bool = False) -> bool:
        """Whether a call to `path` would be shed now (or, `waited`, was when its head came);
        nothing is decided or counted."""
        return (waited or self.full()) and not path.startswith("/_gateway/")

    def done(self, rtt_s: float, now: float) -> None:
        """A counted call was answered `rtt_s` after its head arrived, less the tool's time."""
        try:
            if self._adaptive is not None:
                self.limit = self._adaptive.sample(rtt_s, self.in_flight, now)
        finally:  # the place is given back whatever the sample did
            self.in_flight -= 1

    def abandoned(self) -> None:
        """A counted call will never be handled: its connection closed while it was queued."""
        self.in_flight -= 1

    def _shed(
        self, method: str, target: str, fields: CIMultiDictProxy[str], now: float
    ) -> ShedAnswer:
        # "-": never routed; the children appear with the first shed call (cached by Metrics)
        self._metrics.rejections_of("-", "overloaded").inc()
        self._metrics.requests_of("-", "rejected").inc()
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
        tracing = self._app[appkeys.TRACING]  # None, unless GATEWAY_OTEL (docs/contract.md §21)
        if tracing is not None:
            tracing.shed(method, target, fields, errors.Overloaded.status)
        problem, mcp = self._prepared
        request_id = headers.request_id(fields) or headers.new_request_id()
        return (mcp if self._answers_in_jsonrpc(method, target) else problem).answer(request_id)

    def _answers_in_jsonrpc(self, method: str, target: str) -> bool:
        """As gateway.proxy.mcp.answers_in_jsonrpc decides it, from the head alone."""
        if method != "POST":
            return False
        found = self._policies.route(target.partition("?")[0])
        return found is not None and found[0].mcp


LIMIT = web.AppKey("inflight_limit", InflightLimit)


def install(app: web.Application, setting: int | str) -> None:
    """The limit, for the HTTP server (gateway.server.http_server) to apply."""
    app[LIMIT] = InflightLimit(setting, app)
