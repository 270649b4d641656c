"""Sessions: fenced WebSockets (docs/contract.md §15).

An upgrade to an upstream with `websocket: true` is always fenced, and a lease binds the
socket for as long as it is open:

    checks   steps 1 to 4 of §3 on the upgrade's headers (`gateway.proxy.checks`); a refusal
             is answered in HTTP (problem+json) and leaves a `rejected` session receipt
    admit    step 6: the fence advanced and a `pending` session receipt written; the open
             sessions of the resource with a lower fence are cut (`gateway.proxy.forward`)
    open     older fences leave first; the upstream WebSocket is opened once (a refusal goes
             back as it came); only then is the client's upgrade answered 101
    relay    both ways, message by message, in order, payloads unchanged, each send awaited
             (a slow side slows the other; nothing queues without bound); no message moves
             once the session is cut or this process may no longer forward (§14)
    end      a close from either side, a cut (newer fence, lease ended), idle, a message too
             large, or shutdown: both sides are closed, the upstream's connection aborted if
             it does not answer the close within a second, and the receipt completed
             `succeeded` with its `session` object

An open session keeps its place in its resource's lane (`gateway.proxy.ordering`) with its
fence registered, like a call in flight, and is listed in `OpenSessions` for the watch that
cuts it when its fence or lease stops being current elsewhere (`gateway.upkeep.session_watch`)
and for shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

from gateway.config.policy import ResourceRule, Upstream
from gateway.core import errors
from gateway.core.fences import Issuer
from gateway.core.outcomes import Outcome
from gateway.core.sessions import (
    ABNORMAL,
    ClosedBy,
    Ending,
    SessionRecord,
    closed_by_client,
    closed_by_upstream,
    ended_by_gateway,
)
from gateway.observe import logs
from gateway.proxy import appkeys, checks, headers
from gateway.proxy.flow import Flow
from gateway.proxy.forward import admit, blocked_error, record, take_turn
from gateway.proxy.ordering import Place, clear_to_forward
from gateway.proxy.relay import Head, admitted_headers, stream_back, upstream_headers
from gateway.proxy.upstream import CLOSE_WAIT_S, UpgradeRefused, UpstreamFailure
from gateway.store.base import Call, Refused, Replayed, Store

# The client's handshake headers are the client's own: the gateway makes its own handshake
# with the upstream (and names the subprotocols the client asked for).
_SESSION_DROP = frozenset(
    h.lower()
    for h in (
        headers.REQUEST_ID_HEADER,
        headers.IDEMPOTENCY_HEADER,
        "Sec-WebSocket-Key",
        "Sec-WebSocket-Version",
        "Sec-WebSocket-Extensions",
        "Sec-WebSocket-Protocol",
        "Sec-WebSocket-Accept",
    )
)
_DATA = frozenset({WSMsgType.TEXT, WSMsgType.BINARY})  # counted in the receipt
_RELAYED = _DATA | {WSMsgType.PING, WSMsgType.PONG}
_CLOSE_REASON_MAX = 123  # bytes: a close frame's payload is at most 125, with its code

_Socket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse[Any]


class Tally:
    """What one direction of a session relayed: its text and binary messages, and their
    payload bytes."""

    __slots__ = ("bytes", "messages")

    def __init__(self) -> None:
        self.messages = self.bytes = 0

    def add(self, size: int) -> None:
        self.messages += 1
        self.bytes += size


class Session:
    """One open session, as the relay, the cuts and the watch see it."""

    def __init__(self, call: Call, issuer: Issuer, upstream: Upstream) -> None:
        self.resource, self.fence, self.issuer = call.resource, call.fence, issuer
        self.upstream = upstream.name
        self.max_message_bytes = upstream.max_message_bytes
        self.receipt_id: str | None = None
        self.instance = ""  # the instance that admitted it, the only one that may relay it
        self.ending: Ending | None = None
        self.ended = asyncio.Event()
        self.finished = asyncio.Event()  # the handler is done, its receipt completed
        self._clock = asyncio.get_running_loop().time
        self.last_activity = self._clock()
        self.inward, self.outward = Tally(), Tally()  # from the client to the upstream; back

    @property
    def relaying(self) -> bool:
        return self.ending is None

    def end(self, ending: Ending) -> None:
        """The first end wins; from here on no message moves either way."""
        if self.ending is None:
            self.ending = ending
            self.ended.set()

    def cut(self, closed_by: ClosedBy) -> None:
        self.end(ended_by_gateway(closed_by))

    def lapse(self) -> None:
        """This process may no longer relay for it (docs/contract.md §14, self-fencing)."""
        self.end(ended_by_gateway("error", "instance_lapsed"))

    def touch(self) -> None:
        self.last_activity = self._clock()


class OpenSessions:
    """The sessions open in this process."""

    def __init__(self) -> None:
        self._open: set[Session] = set()
        self.closing = False  # shutting down: a session admitted now is not opened

    def __len__(self) -> int:
        return len(self._open)

    def add(self, session: Session) -> None:
        self._open.add(session)
        if self.closing:
            session.cut("shutdown")

    def discard(self, session: Session) -> None:
        self._open.discard(session)

    def by_resource(self) -> dict[str, list[Session]]:
        grouped: dict[str, list[Session]] = {}
        for session in self._open:
            grouped.setdefault(session.resource, []).append(session)
        return grouped

    async def end_all(self, closed_by: ClosedBy, timeout_s: float) -> None:
        """End every open session and wait, up to `timeout_s`, for their receipts."""
        self.closing = True
        sessions = list(self._open)
        for session in sessions:
            session.cut(closed_by)
        if sessions:
            waits = [asyncio.create_task(s.finished.wait()) for s in sessions]
            _, pending = await asyncio.wait(waits, timeout=max(timeout_s, 0.001))
            for task in pending:
                task.cancel()


def install(app: web.Application) -> None:
    """The registry of open sessions, and their end at shutdown (SIGTERM): each is closed
    (1001, `closed_by: shutdown`) and its receipt completed within the shutdown grace."""
    app[appkeys.SESSIONS] = OpenSessions()
    app.on_shutdown.append(_end_at_shutdown)


async def _end_at_shutdown(app: web.Application) -> None:
    await app[appkeys.SESSIONS].end_all("shutdown", app[appkeys.SETTINGS].shutdown_grace_s)


async def handle(request: web.Request, flow: Flow, upstream: Upstream) -> web.StreamResponse:
    """A WebSocket upgrade to `upstream`: a fenced session."""
    flow.kind, flow.method = "session", "GET"
    if not web.WebSocketResponse().can_prepare(request).ok:
        raise errors.InvalidRequest("not a valid WebSocket upgrade (RFC 6455 §4.1)")
    app = request.app
    async with _checked(request, flow, upstream) as (call, rule, place):
        if request.transport is None or request.transport.is_closing():
            raise errors.InvalidRequest("the client went away before admission")
        session = Session(call, rule.lease.issuer, upstream)
        place.cut = session.cut  # from before admission: a newer fence admitted meanwhile cuts it
        opened, in_flight = app[appkeys.SESSIONS], app[appkeys.IN_FLIGHT]
        try:
            result = await admit(app, call, place)
            if isinstance(result, Refused):
                raise checks.error_for(result)
            if isinstance(result, Replayed):  # admission never replays a call without a key
                raise errors.GatewayError("a session's admission was answered with a replay")
            flow.admitted, session.receipt_id = result, result.receipt_id
            session.instance = result.instance
            opened.add(session)
            in_flight.add(result.receipt_id)
            return await _open(request, flow, upstream, rule, call, place, session)
        finally:
            place.cut = None
            opened.discard(session)
            if session.receipt_id is not None:
                in_flight.discard(session.receipt_id)
            session.finished.set()


@asynccontextmanager
async def _checked(
    request: web.Request, flow: Flow, upstream: Upstream
) -> AsyncIterator[tuple[Call, ResourceRule, Place]]:
    """Steps 1 to 4 of §3 on the upgrade's headers (no body, no key: step 5 does not apply),
    then the turn of a serial resource. A refusal, once resource and fence are readable, is
    kept as a `rejected` session receipt."""
    app = request.app
    try:
        rule = checks.rule_of(request, flow, upstream)
        flow.fence = headers.parse_fence(request.headers)
        flow.owner = headers.parse_owner(request.headers)
        checks.check_signature(request, rule, flow)
    except errors.GatewayError as error:
        await checks.keep_rejection(request, flow, error)
        raise
    # a session is never replayed and takes no key (docs/contract.md §15)
    call = flow.admission(rule, None, None, frozenset(), app[appkeys.CLIENTS] is not None)
    async with app[appkeys.LANES].join(call.resource) as place:
        try:
            await take_turn(rule, call.resource, place)
        except errors.GatewayError as error:
            await checks.keep_rejection(request, flow, error)
            raise
        yield call, rule, place


async def _open(
    request: web.Request,
    flow: Flow,
    upstream: Upstream,
    rule: ResourceRule,
    call: Call,
    place: Place,
    session: Session,
) -> web.StreamResponse:
    """From the `pending` receipt to an open session, relayed until it ends."""
    app = request.app
    store = app[appkeys.STORE]
    admitted = flow.admitted
    assert admitted is not None and session.receipt_id is not None
    receipt_id = session.receipt_id
    answer_headers = {
        headers.RECEIPT_HEADER: receipt_id,
        headers.REQUEST_ID_HEADER: flow.request_id,
        headers.FENCE_HEADER: str(call.fence),
    }
    blocked = await clear_to_forward(place, rule.queue_timeout_s, store, call, admitted)
    if blocked is None and not store.may_forward(admitted.instance):
        blocked = "instance_lapsed"
    if blocked is not None:  # not sent: the way was not clear
        error = blocked_error(blocked, call.resource, rule.queue_timeout_s)
    elif session.ending is not None:  # not sent: the session was cut before it opened
        blocked, error = session.ending.reason, _cut_error(session.ending)
    if blocked is not None:
        flow.outcome = "not_sent"
        await record(app, receipt_id, Outcome("not_sent", error=blocked))
        error.headers.update(answer_headers)
        raise error

    sent = upstream_headers(
        request,
        upstream,
        _SESSION_DROP,
        admitted_headers(rule, call.resource, call.fence, None, receipt_id, flow.request_id),
        app[appkeys.SETTINGS].trusted_networks,
    )
    deadline = asyncio.get_running_loop().time() + upstream.timeout_s
    forwarded_at = time.time()
    try:
        upstream_ws = await app[appkeys.UPSTREAMS].open_websocket(
            upstream,
            flow.rest,
            sent,
            _protocols(request),
            deadline,
            may_send=lambda: store.may_forward(admitted.instance),
        )
    except UpgradeRefused as refused:
        app[appkeys.METRICS].upstream.labels(upstream.name).observe(time.time() - forwarded_at)
        flow.status = refused.status
        outcome = Outcome("failed", http_status=refused.status, forwarded_at=forwarded_at)
        flow.outcome = outcome.status
        if not await record(app, receipt_id, outcome):
            answer_headers["X-Receipt-Outcome"] = "unrecorded"
        return await _refusal(request, refused, answer_headers, upstream)
    except UpstreamFailure as failure:
        app[appkeys.METRICS].upstream.labels(upstream.name).observe(time.time() - forwarded_at)
        outcome = failure.as_outcome(forwarded_at)
        flow.outcome = outcome.status
        if outcome.status == "outcome_unknown":
            app[appkeys.METRICS].outcome_unknown.labels(upstream.name).inc()
        if not await record(app, receipt_id, outcome):
            answer_headers["X-Receipt-Outcome"] = "unrecorded"
        failure.error.headers.update(answer_headers)
        raise failure.error from None
    app[appkeys.METRICS].upstream.labels(upstream.name).observe(time.time() - forwarded_at)

    opened = SessionRecord(opened_at=time.time())
    client_ws = web.WebSocketResponse(
        protocols=(upstream_ws.protocol,) if upstream_ws.protocol else (),
        autoclose=False,
        autoping=False,
        max_msg_size=reader_limit(upstream),
        compress=False,
        timeout=CLOSE_WAIT_S,
        decode_text=False,
    )
    client_ws.headers.update(answer_headers)
    if session.ending is None:
        try:
            await store.session_opened(receipt_id, opened)
        except errors.StoreUnavailable as exc:  # the receipt stays `pending`: still a session
            logs.event("store_write_failed", logging.WARNING, error=str(exc))
    if session.ending is not None:  # cut while the upstream was being opened
        ending = session.ending
        await _close_upstream(upstream_ws, ending)
        place.leave()
        await _finish(app, flow, session, opened, ending, forwarded_at)
        error = _cut_error(ending)
        error.headers.update(answer_headers)
        raise error
    try:
        await client_ws.prepare(request)
    except (ConnectionError, RuntimeError):  # the client left before its upgrade was answered
        ending = closed_by_client(None)
        session.end(ending)
        await _close_upstream(upstream_ws, ending)
        place.leave()
        await _finish(app, flow, session, opened, ending, forwarded_at)
        return client_ws
    flow.status = 101
    place.release_turn()  # open: the next serial call may go; the fence stays registered
    gauge = app[appkeys.METRICS].sessions_open.labels(upstream.name)
    gauge.inc()
    outward: asyncio.Task[None] | None = None
    try:
        ending, outward = await _relay(session, client_ws, upstream_ws, store, upstream)
        await _close_upstream(upstream_ws, ending)
        place.leave()  # the upstream side is closed: a newer call or session may go now
        await asyncio.gather(
            _close(client_ws, ending.to_client, ending, request.transport),
            _finish(app, flow, session, opened, ending, forwarded_at),
        )
    finally:
        gauge.dec()
        if outward is not None:
            outward.cancel()
            await asyncio.gather(outward, return_exceptions=True)
    return client_ws


async def _relay(
    session: Session,
    client_ws: web.WebSocketResponse,
    upstream_ws: aiohttp.ClientWebSocketResponse[Any],
    store: Store,
    upstream: Upstream,
) -> tuple[Ending, asyncio.Task[None]]:
    """Relay both ways until the session ends; from then on no message moves. The task that
    reads the upstream is handed back still running: cancelling a read of aiohttp's client
    WebSocket marks it broken, and its close would then not wait for the upstream's reply.
    Closing it ends that read instead."""
    # idle counts from the moment the session opens, not from its admission: the wait for
    # older calls of the resource and the tool's handshake are not the client's silence
    session.touch()
    outward = asyncio.create_task(_pump(session, upstream_ws, client_ws, store, inward=False))
    tasks = [
        asyncio.create_task(_pump(session, client_ws, upstream_ws, store, inward=True)),
        asyncio.create_task(_idle(session, upstream.session_idle_timeout_s)),
    ]
    try:
        await session.ended.wait()
    except BaseException:
        outward.cancel()
        raise
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert session.ending is not None
    return session.ending, outward


async def _pump(
    session: Session, source: _Socket, sink: _Socket, store: Store, *, inward: bool
) -> None:
    """One direction, `inward` from the client to the upstream, else back. Every message is
    checked, right before it is sent, against a cut and against this process's right to
    forward (docs/contract.md §14, self-fencing). Data either way counts as activity, and so
    do the client's pings and pongs, never the upstream's."""
    # fixed for the session, not looked up per message
    source_end, sink_end = (
        (closed_by_client, closed_by_upstream) if inward else (closed_by_upstream, closed_by_client)
    )
    activity = _RELAYED if inward else _DATA
    tally = session.inward if inward else session.outward
    instance = session.instance
    while True:
        message = await source.receive()
        kind = message.type
        if kind in _RELAYED:
            if not session.relaying:
                return
            if not store.may_forward(instance):
                session.lapse()
                return
            if _too_large(session, message.data):
                return
            if kind in activity:
                session.touch()
            try:
                await _send(sink, kind, message.data)
            except (ConnectionError, aiohttp.ClientError, RuntimeError):
                session.end(sink_end(None))
                return
            if kind in _DATA:
                tally.add(len(message.data))
        elif kind is WSMsgType.CLOSE:
            session.end(source_end(message.data, message.extra or ""))
            return
        elif kind is WSMsgType.ERROR:
            session.end(_error_ending(message.data, source_end))
            return
        else:  # CLOSING, CLOSED: the connection went away
            session.end(source_end(None))
            return


async def _send(ws: _Socket, kind: WSMsgType, data: bytes) -> None:
    """One frame as it came: a text message's payload is passed on as bytes, never decoded
    and encoded again. Awaited: a slow reader slows the relay (backpressure)."""
    if kind is WSMsgType.PING:
        await ws.ping(data)
    elif kind is WSMsgType.PONG:
        await ws.pong(data)
    else:
        await ws.send_frame(data, kind)


def reader_limit(upstream: Upstream) -> int:
    """aiohttp's `max_msg_size` refuses a message of exactly that size; `max_message_bytes`
    allows it. The relay checks the limit itself too (`_too_large`), whatever the release."""
    return upstream.max_message_bytes + 1


def _too_large(session: Session, data: bytes) -> bool:
    if len(data) > session.max_message_bytes:
        session.cut("limit")
        return True
    return False


def _error_ending(exc: object, side: Callable[[int | None], Ending]) -> Ending:
    """A side's connection failed: a message over `max_message_bytes` is the gateway's
    `limit` (1009), anything else that side's end (its protocol error code, if any)."""
    code = exc.code if isinstance(exc, aiohttp.WebSocketError) else None
    if code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
        return ended_by_gateway("limit")
    return side(code)


async def _idle(session: Session, idle_s: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        left = session.last_activity + idle_s - loop.time()
        if left <= 0:
            session.cut("idle")
            return
        await asyncio.sleep(left)


async def _close_upstream(
    upstream_ws: aiohttp.ClientWebSocketResponse[Any], ending: Ending
) -> None:
    await _close(upstream_ws, ending.to_upstream, ending, _transport_of(upstream_ws))


async def _close(
    ws: _Socket, code: int, ending: Ending, transport: asyncio.Transport | None
) -> None:
    """Send the close frame, wait at most `CLOSE_WAIT_S` for the other side's, then abort the
    TCP connection (docs/contract.md §15)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(CLOSE_WAIT_S + 0.25):
            await ws.close(code=code, message=_reason(ending))
    if ws.close_code in (None, ABNORMAL) and transport is not None:
        transport.abort()


async def _finish(
    app: web.Application,
    flow: Flow,
    session: Session,
    opened: SessionRecord,
    ending: Ending,
    forwarded_at: float,
) -> None:
    """Complete the receipt `succeeded` with the session's object; count it and give its
    fields to the log line of the call."""
    closed = SessionRecord(
        opened_at=opened.opened_at,
        messages_in=session.inward.messages,
        messages_out=session.outward.messages,
        bytes_in=session.inward.bytes,
        bytes_out=session.outward.bytes,
    ).closed(ending, time.time())
    assert session.receipt_id is not None
    outcome = Outcome("succeeded", http_status=101, forwarded_at=forwarded_at, session=closed)
    flow.outcome = outcome.status
    await record(app, session.receipt_id, outcome)
    app[appkeys.METRICS].sessions.labels(session.upstream, ending.closed_by).inc()
    flow.session = {
        k: v for k, v in closed.to_json().items() if k not in ("opened_at", "closed_at")
    }


def _cut_error(ending: Ending) -> errors.GatewayError:
    """What a client whose session was cut before its upgrade was answered is told."""
    if ending.closed_by == "lease_ended":
        return errors.LeaseExpired("the lease ended before the session opened")
    if ending.closed_by != "fenced":
        return errors.ResourceBusy("the gateway is shutting down", retry_after=1)
    return errors.StaleFence("a newer fence was admitted before the session opened")


async def _refusal(
    request: web.Request, refused: UpgradeRefused, extra: dict[str, str], upstream: Upstream
) -> web.StreamResponse:
    """The upstream's answer to a refused upgrade, as it came, with the receipt's headers."""
    head = Head(refused.status, refused.headers, refused.body, complete=True, broken=False)
    deadline = asyncio.get_running_loop().time() + upstream.timeout_s
    response, _ = await stream_back(request, head, None, extra, deadline)
    return response


def _protocols(request: web.Request) -> tuple[str, ...]:
    return tuple(
        token.strip()
        for value in request.headers.getall("Sec-WebSocket-Protocol", [])
        for token in value.split(",")
        if token.strip()
    )


def _reason(ending: Ending) -> bytes:
    return ending.reason.encode()[:_CLOSE_REASON_MAX].decode("utf-8", "ignore").encode()


def _transport_of(ws: aiohttp.ClientWebSocketResponse[Any]) -> asyncio.Transport | None:
    """The upstream connection's transport, to abort it when its close is not answered
    (aiohttp's own close only closes it gracefully, which waits for a peer that may never
    read again). aiohttp exposes it on the frame writer only."""
    writer = getattr(ws, "_writer", None)
    transport = getattr(writer, "transport", None)
    return transport if isinstance(transport, asyncio.Transport) else None
