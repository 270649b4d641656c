"""Sending one call to an upstream, at most once, and naming what became of it.

One `ClientSession` per upstream (its own connection pool and limits). Transport errors are
mapped to the outcomes of docs/contract.md §3 by whether a connection was in hand when they
happened: before it, nothing was sent (`not_sent`); after it, the tool may have acted
(`outcome_unknown`).

An upstream that accepts WebSocket upgrades (docs/contract.md §15) has a second session for
them, so that open sessions, which hold their connection for minutes, never take the pool
its calls need. A refused upgrade's answer (status, headers, body) is kept to be passed back:
aiohttp's `ws_connect` drops the body, so a trace hook reads it first.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import aiohttp
from aiohttp.abc import AbstractStreamWriter
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from multidict import CIMultiDict
from yarl import URL

from gateway.config.policy import Upstream
from gateway.config.tls import ssl_context_for
from gateway.core import errors
from gateway.core.outcomes import Outcome
from gateway.proxy.headers import HOP_BY_HOP, connection_named

# aiohttp adds these unless told not to; a proxy passes on what the client sent, nothing more.
_SKIP_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


@dataclass(slots=True)
class UpstreamFailure(Exception):
    """The call failed in transport: `outcome` for the receipt, `error` for the client."""

    outcome: Literal["not_sent", "outcome_unknown"]
    error: errors.GatewayError
    reason: str | None = None  # the receipt's `error`, when not the client's error code

    def as_outcome(self, forwarded_at: float) -> Outcome:
        """For the receipt: `not_sent` was never forwarded; anything else may have been."""
        return Outcome(
            self.outcome,
            error=self.reason or self.error.code,
            forwarded_at=None if self.outcome == "not_sent" else forwarded_at,
        )


class _Withdrawn(Exception):
    """The last check before the bytes leave said no (`Upstreams.send`'s `may_send`)."""


# What the caller of a call this process may no longer send is told (`instance_lapsed`).
LAPSED = (
    "this gateway process lost its heartbeat with the store, so peers may already be "
    "recovering its calls; the call was not sent"
)


@dataclass(slots=True)
class _Attempt:
    """One call on its way to the tool (`Upstreams.send`), as its connector sees it."""

    may_send: Callable[[], bool] | None  # the last check, asked once a connection is in hand
    connected: bool = False  # a connection was in hand: from here on the tool may act
    withdrawn: bool = False  # the check said no just before the body's write: nothing left


_ATTEMPT: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar(
    "fence_gateway_attempt", default=None
)


# The answer to a refused upgrade is read up to this size; a longer body is cut there.
REFUSAL_MAX_BYTES = 1024 * 1024
# How long a side may take to answer the gateway's close frame before its connection is
# aborted (docs/contract.md §15).
CLOSE_WAIT_S = 1.0


@dataclass(slots=True)
class UpgradeRefused(Exception):
    """The upstream answered an upgrade with something else than 101: passed back as it is."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass(slots=True)
class _Handshake:
    """What the trace hooks learn about one upgrade (ws_connect takes no trace context)."""

    connected: bool = False
    refused: UpgradeRefused | None = None
    extra: dict[str, str] = field(default_factory=dict)


_HANDSHAKE: contextvars.ContextVar[_Handshake | None] = contextvars.ContextVar(
    "fence_gateway_handshake", default=None
)


async def _on_ws_connection(_session: Any, _ctx: SimpleNamespace, _params: Any) -> None:
    state = _HANDSHAKE.get()
    if state is not None:
        state.connected = True


async def _on_ws_answer(
    _session: Any, _ctx: SimpleNamespace, params: aiohttp.TraceRequestEndParams
) -> None:
    """Runs in the upgrading task before ws_connect looks at the status: a refusal's body is
    read here, while the connection is still open."""
    state, response = _HANDSHAKE.get(), params.response
    if state is None or response.status == 101:
        return
    chunks, size = [], 0
    try:
        while size < REFUSAL_MAX_BYTES:
            chunk = await response.content.read(REFUSAL_MAX_BYTES - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except (aiohttp.ClientError, OSError):
        pass  # what arrived is passed back
    removed = HOP_BY_HOP | connection_named(response.headers) | {"content-length"}
    kept = [(k, v) for k, v in response.headers.items() if k.lower() not in removed]
    state.refused = UpgradeRefused(response.status, kept, b"".join(chunks))


class _CheckedRequest(aiohttp.ClientRequest):
    """aiohttp's request, asking the call's `may_send` once more just before its bytes leave.

    aiohttp buffers a request's head and writes it with the first chunk of the body, in a task
    of its own started after the connection is in hand (on Python 3.11 it starts on a later
    turn of the event loop). Whatever the loop runs in between, and a pause of the process
    there, would separate the connector's check from the write; asked again at the start of
    that task, with nothing written yet, the check and the write are one step apart. A call
    without a body has no such task: its head is written right after the connector's check.
    """

    async def write_bytes(
        self, writer: AbstractStreamWriter, conn: Connection, content_length: int | None = None
    ) -> None:
        attempt = _ATTEMPT.get()
        if attempt is not None and attempt.may_send is not None and not attempt.may_send():
            attempt.withdrawn = True
            assert conn.protocol is not None
            # the answer's reader raises it: nothing was written, and the connection closes
            conn.protocol.set_exception(_Withdrawn())
            conn.close()
            return
        await super().write_bytes(writer, conn, content_length)


class _CallConnector(aiohttp.TCPConnector):
    """aiohttp's connector, with what a call needs of the connection it is given.

    The last check before the bytes leave (docs/contract.md §14, "A replica fences itself"):
    once a connection is in hand, new or pooled, and nothing is written yet, the call's
    `may_send` is asked. When it says no, the connection is closed (neither pooled nor left
    open) and nothing is sent. That a connection was in hand is noted: it is what tells
    `not_sent` from `outcome_unknown`.

    An idle keep-alive connection on which the tool sent anything is closed, not reused. A
    tool that sends more than its answer's framing says (a body longer than its
    Content-Length, a second answer nobody asked for) leaves bytes on the connection after
    the gateway has the whole answer and has pooled it. aiohttp parses them as an answer and
    hands the connection to the next call, which then takes them for its own answer: another
    client's call would get this tool's leftovers, and its receipt the wrong outcome. A
    pooled connection with anything buffered (`should_close`) is dropped instead.
    """

    async def connect(
        self, req: aiohttp.ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout
    ) -> Connection:
        connection = await super().connect(req, traces, timeout)
        attempt = _ATTEMPT.get()
        if attempt is not None:
            if attempt.may_send is not None and not attempt.may_send():
                connection.close()
                raise _Withdrawn
            attempt.connected = True
        return connection

    async def _get(self, key: Any, traces: Any) -> Any:
        idle = self._conns.get(key)
        if idle:
            for entry in [entry for entry in idle if entry[0].should_close]:
                idle.remove(entry)
                entry[0].close()
        return await super()._get(key, traces)


class Upstreams:
    """The sessions of all upstreams; opened and closed with the app."""

    def __init__(self, upstreams: dict[str, Upstream]) -> None:
        self._config = upstreams
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._ws_sessions: dict[str, aiohttp.ClientSession] = {}

    async def open(self) -> None:
        require_no_resend_switch()
        ws_trace = aiohttp.TraceConfig()
        ws_trace.on_connection_create_end.append(_on_ws_connection)
        ws_trace.on_request_end.append(_on_ws_answer)
        for name, upstream in self._config.items():
            self._sessions[name] = _client_session(upstream, [])
            if upstream.websocket:  # open sessions never take the pool its calls need
                self._ws_sessions[name] = _client_session(upstream, [ws_trace])

    async def close(self) -> None:
        sessions = [*self._sessions.values(), *self._ws_sessions.values()]
        await asyncio.gather(*(s.close() for s in sessions))
        self._sessions.clear()
        self._ws_sessions.clear()

    async def open_websocket(
        self,
        upstream: Upstream,
        rest: str,
        headers: CIMultiDict[str],
        protocols: tuple[str, ...],
        deadline: float,
        may_send: Callable[[], bool] | None = None,
    ) -> aiohttp.ClientWebSocketResponse[Literal[False]]:
        """Open the upstream WebSocket of a session, once (docs/contract.md §15): the handshake
        within `connect_timeout_s` and `deadline` (`timeout_s`), then no timeout at all.
        `may_send` is asked as in `send`, before the handshake is written.
        Raises `UpgradeRefused` (a non-101 answer) or `UpstreamFailure`."""
        state = _Handshake()
        attempt = _Attempt(may_send)
        token, attempt_token = _HANDSHAKE.set(state), _ATTEMPT.set(attempt)
        url = URL(upstream.url + rest, encoded=True)
        try:
            async with asyncio.timeout_at(deadline):
                return await self._ws_sessions[upstream.name].ws_connect(
                    url,
                    headers=headers,
                    protocols=protocols,
                    autoclose=False,
                    autoping=False,
                    # aiohttp refuses a message of exactly max_msg_size; the limit allows it
                    max_msg_size=upstream.max_message_bytes + 1,
                    compress=0,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=CLOSE_WAIT_S),
                    decode_text=False,
                )
        except Exception as exc:
            if state.refused is not None:
                raise state.refused from None
            if isinstance(exc, _Withdrawn) or attempt.withdrawn:
                raise _lapsed() from None
            raise _classify(exc, state.connected, upstream) from exc
        finally:
            _ATTEMPT.reset(attempt_token)
            _HANDSHAKE.reset(token)

    async def send(
        self,
        upstream: Upstream,
        method: str,
        rest: str,
        headers: CIMultiDict[str],
        body: bytes | None,
        deadline: float,
        may_send: Callable[[], bool] | None = None,
    ) -> aiohttp.ClientResponse:
        """Send once and return the response with its head read; raise `UpstreamFailure`.

        `rest` is the path after the mount plus the query, forwarded with its encoding as it
        came; `deadline` (loop time) bounds the whole call, `timeout_s` of the upstream.
        `may_send` is asked once a connection is in hand, before anything is written (a wait
        for a free connection or a new one can be long): False, and nothing is sent.
        """
        attempt = _Attempt(may_send)
        token = _ATTEMPT.set(attempt)  # for the connector (`_CallConnector.connect`)
        url = URL(upstream.url + rest, encoded=True)
        try:
            async with asyncio.timeout_at(deadline):
                return await self._sessions[upstream.name].request(
                    method, url, headers=headers, data=body, allow_redirects=False
                )
        except Exception as exc:
            if isinstance(exc, _Withdrawn) or attempt.withdrawn:
                raise _lapsed() from None
            raise _classify(exc, attempt.connected, upstream) from exc
        finally:
            _ATTEMPT.reset(token)


def _lapsed() -> UpstreamFailure:
    """A call the last check withdrew: nothing of it was written."""
    return UpstreamFailure(
        "not_sent", errors.StoreUnavailable(LAPSED, retry_after=1), reason="instance_lapsed"
    )


def _classify(exc: BaseException, connected: bool, upstream: Upstream) -> UpstreamFailure:
    # A request head aiohttp cannot encode fails whole, before any byte of it is written.
    if not connected or isinstance(exc, UnicodeEncodeError):
        return UpstreamFailure(
            "not_sent",
            errors.UpstreamUnreachable(
                f"upstream {upstream.name} could not be reached: {_describe(exc)}"
            ),
        )
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamFailure(
            "outcome_unknown",
            errors.UpstreamTimeout(
                f"upstream {upstream.name} did not answer within {upstream.timeout_s}s; "
                "the call may have been applied"
            ),
        )
    return UpstreamFailure(
        "outcome_unknown",
        errors.UpstreamOutcomeUnknown(
            f"upstream {upstream.name} broke the connection after the call was sent: "
            f"{_describe(exc)}; the call may have been applied"
        ),
    )


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _client_session(upstream: Upstream, traces: list[aiohttp.TraceConfig]) -> aiohttp.ClientSession:
    """A session of `upstream`'s own: its pool and limits, bytes passed on as they are."""
    session = aiohttp.ClientSession(
        connector=_CallConnector(
            limit=upstream.max_connections,
            # plain http has no use for it; ssl=True would be aiohttp's own default context
            ssl=ssl_context_for(upstream.tls) if upstream.url.startswith("https:") else True,
        ),
        request_class=_CheckedRequest,
        auto_decompress=False,
        trace_configs=traces,
        skip_auto_headers=_SKIP_AUTO_HEADERS,
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, connect=upstream.connect_timeout_s),
    )
    # aiohttp silently resends PUT, DELETE and other "idempotent" methods once when a reused
    # keep-alive connection turns out dead. A fenced call must reach the tool at most once, so
    # that retry is switched off (there is no public switch).
    session._retry_connection = False
    return session


def require_no_resend_switch() -> None:
    """Refuse to run on an aiohttp whose client cannot be told not to resend a call.

    aiohttp resends PUT, DELETE and other "idempotent" methods once when a reused keep-alive
    connection turns out dead. Since 3.11 `ClientSession._retry_connection` switches that off
    (`_client_session` sets it); before, the attribute did not exist, setting it did nothing,
    and a fenced call could reach its tool twice. `ClientSession.ATTRS` lists the attributes
    a session carries: the switch is among them in every release that reads it (3.11 on) and
    in none before.
    """
    floor = "3.14.4"  # pyproject.toml's aiohttp floor
    session = aiohttp.ClientSession
    known = {*getattr(session, "ATTRS", ()), *getattr(session, "__slots__", ())}
    if "_retry_connection" not in known:
        raise RuntimeError(
            f"aiohttp {aiohttp.__version__} is installed, but fence-gateway needs aiohttp>="
            f"{floor}: this one cannot be told not to resend a PUT or DELETE on a dead "
            "keep-alive connection, so a fenced call could reach its tool twice"
        )
