"""Sending one call to an upstream, at most once, and naming what became of it.

Proxied calls, cleanups and probes go on the gateway's own HTTP/1.1 client (`gateway.wire`):
one pool of keep-alive connections per upstream, its limits the upstream's. Its errors say by
their type whether the request may have left; they are mapped here to the outcomes of
docs/contract.md §3: before the write, nothing was sent (`not_sent`); after it, the tool may
have acted (`outcome_unknown`).

An upstream that accepts WebSocket upgrades (docs/contract.md §15) has an aiohttp session for
them, so that open sessions, which hold their connection for minutes, never take the pool
its calls need. A refused upgrade's answer (status, headers, body) is kept to be passed back:
aiohttp's `ws_connect` drops the body, so a trace hook reads it first.
"""

from __future__ import annotations

import asyncio
import contextvars
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from multidict import CIMultiDict
from yarl import URL

from gateway.config.policy import Upstream
from gateway.config.tls import ssl_context_for
from gateway.core import errors
from gateway.core.outcomes import Outcome
from gateway.proxy.headers import HOP_BY_HOP, connection_named
from gateway.wire import errors as wire
from gateway.wire.answer import Answer
from gateway.wire.pool import Pool

# aiohttp adds these to a session's handshake unless told not to; a proxy passes on what the
# client sent, nothing more.
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
    """The last check before a handshake leaves said no (`open_websocket`'s `may_send`)."""


# What the caller of a call this process may no longer send is told (`instance_lapsed`).
LAPSED = (
    "this gateway process lost its heartbeat with the store, so peers may already be "
    "recovering its calls; the call was not sent"
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
    """One upgrade, as its connector and trace hook see it (ws_connect takes no trace
    context): the last check to ask, whether a connection was in hand, a refusal."""

    may_send: Callable[[], bool] | None
    connected: bool = False  # a connection was in hand: from here on the tool may act
    refused: UpgradeRefused | None = None


_HANDSHAKE: contextvars.ContextVar[_Handshake | None] = contextvars.ContextVar(
    "fence_gateway_handshake", default=None
)


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


class _HandshakeConnector(aiohttp.TCPConnector):
    """aiohttp's connector, with what a session's handshake needs of its connection.

    The last check before the bytes leave (docs/contract.md §14, "A replica fences itself"):
    once a connection is in hand, new or pooled, and nothing is written yet, the session's
    `may_send` is asked. When it says no, the connection is closed (neither pooled nor left
    open) and nothing is sent. A handshake has no body, so aiohttp writes its head right
    after this check, with no task of its own in between. That a connection was in hand is
    noted: it is what tells `not_sent` from `outcome_unknown`.

    An idle keep-alive connection (one a refused upgrade left) on which the tool sent
    anything is closed, not reused: aiohttp would parse those bytes as the answer to the
    next handshake. A pooled connection with anything buffered (`should_close`) is dropped.
    """

    async def connect(
        self, req: aiohttp.ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout
    ) -> Connection:
        connection = await super().connect(req, traces, timeout)
        state = _HANDSHAKE.get()
        if state is not None:
            if state.may_send is not None and not state.may_send():
                connection.close()
                raise _Withdrawn
            state.connected = True
        return connection

    async def _get(self, key: Any, traces: Any) -> Any:
        idle = self._conns.get(key)
        if idle:
            for entry in [entry for entry in idle if entry[0].should_close]:
                idle.remove(entry)
                entry[0].close()
        return await super()._get(key, traces)


class Upstreams:
    """The connection pools of all upstreams; opened and closed with the app."""

    def __init__(self, upstreams: dict[str, Upstream]) -> None:
        self._config = upstreams
        self._pools: dict[str, Pool] = {}
        self._base_paths: dict[str, str] = {}
        self._ws_sessions: dict[str, aiohttp.ClientSession] = {}

    async def open(self) -> None:
        require_no_resend_switch()
        ws_trace = aiohttp.TraceConfig()
        ws_trace.on_request_end.append(_on_ws_answer)
        for name, upstream in self._config.items():
            self._pools[name] = _pool(upstream)
            self._base_paths[name] = urlsplit(upstream.url).path
            if upstream.websocket:  # open sessions never take the pool its calls need
                self._ws_sessions[name] = _ws_session(upstream, ws_trace)

    async def close(self) -> None:
        await asyncio.gather(
            *(pool.close() for pool in self._pools.values()),
            *(session.close() for session in self._ws_sessions.values()),
        )
        self._pools.clear()
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
        state = _Handshake(may_send)
        token = _HANDSHAKE.set(state)
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
            if isinstance(exc, _Withdrawn):
                raise _lapsed() from None
            # a head aiohttp cannot encode fails whole, before any byte of it is written
            sent = state.connected and not isinstance(exc, UnicodeEncodeError)
            timed_out = isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError)
            raise _classify(exc, sent, timed_out, upstream) from exc
        finally:
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
    ) -> Answer:
        """Send once and return the answer with its head read; raise `UpstreamFailure`.

        `rest` is the path after the mount plus the query, forwarded with its encoding as it
        came; `deadline` (loop time) bounds the whole call, `timeout_s` of the upstream.
        `may_send` is asked once a connection is in hand (a wait for a free connection or a
        new one can be long), in the same step as the write: False, and nothing is sent.
        """
        target = self._base_paths[upstream.name] + rest
        if not target.startswith("/"):
            target = "/" + target  # an upstream URL without a path, and a bare query
        try:
            return await self._pools[upstream.name].send(
                method, target, headers, body, deadline, may_send
            )
        except wire.Withdrawn:
            raise _lapsed() from None
        except wire.WireError as exc:
            sent = isinstance(exc, wire.MaybeSent)
            raise _classify(exc, sent, isinstance(exc, wire.ReadTimeout), upstream) from exc


def _lapsed() -> UpstreamFailure:
    """A call the last check withdrew: nothing of it was written."""
    return UpstreamFailure(
        "not_sent", errors.StoreUnavailable(LAPSED, retry_after=1), reason="instance_lapsed"
    )


def _classify(
    exc: BaseException, sent: bool, timed_out: bool, upstream: Upstream
) -> UpstreamFailure:
    if not sent:
        return UpstreamFailure(
            "not_sent",
            errors.UpstreamUnreachable(
                f"upstream {upstream.name} could not be reached: {_describe(exc)}"
            ),
        )
    if timed_out:
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


def _pool(upstream: Upstream) -> Pool:
    """The pool of `upstream`'s calls: its limits, its host, its TLS settings."""
    parts = urlsplit(upstream.url)
    host = parts.hostname or ""  # the policy refuses a URL without one
    secure = parts.scheme == "https"
    return Pool(
        host,
        parts.port or (443 if secure else 80),
        limit=upstream.max_connections,
        connect_timeout_s=upstream.connect_timeout_s,
        tls=_tls_of(upstream),
        # SNI and the name the certificate must carry, unless the context names the
        # upstream's `tls.server_name` instead (`gateway.config.tls`)
        server_hostname=host,
    )


def _tls_of(upstream: Upstream) -> ssl.SSLContext | None:
    """The context an `https://` upstream is reached with (its `tls` settings); None for
    plain http."""
    return ssl_context_for(upstream.tls) if upstream.url.startswith("https:") else None


def _ws_session(upstream: Upstream, trace: aiohttp.TraceConfig) -> aiohttp.ClientSession:
    """The session of `upstream`'s WebSocket handshakes: bytes passed on as they are."""
    session = aiohttp.ClientSession(
        connector=_HandshakeConnector(
            limit=upstream.max_connections,
            # plain http has no use for it; ssl=True would be aiohttp's own default context
            ssl=_tls_of(upstream) or True,
        ),
        auto_decompress=False,
        trace_configs=[trace],
        skip_auto_headers=_SKIP_AUTO_HEADERS,
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, connect=upstream.connect_timeout_s),
    )
    # aiohttp silently resends "idempotent" methods, a handshake's GET among them, once when a
    # reused keep-alive connection turns out dead. A session must reach the tool at most
    # once, so that retry is switched off (there is no public switch).
    session._retry_connection = False
    return session


def require_no_resend_switch() -> None:
    """Refuse to run on an aiohttp whose client cannot be told not to resend a call.

    aiohttp resends GET, PUT, DELETE and other "idempotent" requests once when a reused
    keep-alive connection turns out dead. Proxied calls go through the gateway's own client
    (gateway.wire), which never resends; a session's handshake still goes through aiohttp's.
    Since 3.11 `ClientSession._retry_connection` switches the resend off (`_client_session`
    sets it); before, the attribute did not exist, setting it did nothing, and a fenced
    handshake could reach its tool twice. `ClientSession.ATTRS` lists the attributes
    a session carries: the switch is among them in every release that reads it (3.11 on) and
    in none before.
    """
    floor = "3.14.4"  # pyproject.toml's aiohttp floor
    session = aiohttp.ClientSession
    known = {*getattr(session, "ATTRS", ()), *getattr(session, "__slots__", ())}
    if "_retry_connection" not in known:
        raise RuntimeError(
            f"aiohttp {aiohttp.__version__} is installed, but fence-gateway needs aiohttp>="
            f"{floor}: this one cannot be told not to resend a request on a dead "
            "keep-alive connection, so a fenced session's handshake could reach its tool twice"
        )
