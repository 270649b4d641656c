"""The one path of an admitted call: take a turn, admit, wait for older fences, send once,
record the outcome before anything goes back (docs/contract.md §3, steps 3c to 6, "Ordering
on takeover", "Outcome").

Proxied calls and the sweeper's cleanup calls both come this way; what differs is only who
hears the answer. `forward` ends at the recorded outcome and hands over the exchange: the
proxy streams it back to its client, a cleanup reads its outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import get_args

from aiohttp import web

from gateway.config.policy import ResourceRule, Upstream
from gateway.core import errors
from gateway.core.fences import FenceRefusal
from gateway.core.outcomes import Completion, Outcome
from gateway.observe import logs
from gateway.proxy import appkeys, headers
from gateway.proxy.failpoints import Failpoints
from gateway.proxy.flow import Flow
from gateway.proxy.ordering import Place, clear_to_forward
from gateway.proxy.relay import Head, admitted_headers, read_head, upstream_headers
from gateway.proxy.upstream import LAPSED, UpstreamFailure
from gateway.store.base import Admitted, Call, Refused, Replayed
from gateway.wire.answer import Answer

# Client headers never passed on for a fenced call: the gateway sets its own key header.
_FENCED_DROP = frozenset({headers.IDEMPOTENCY_HEADER.lower(), headers.REQUEST_ID_HEADER.lower()})

# Why an admitted call was not sent (the receipt's `error`) → the error the caller gets.
_BLOCKED = {
    "resource_busy": (
        errors.ResourceBusy,
        "older calls of {resource!r} stayed in flight for {timeout}s",
    ),
    "store_unavailable": (
        errors.StoreUnavailable,
        "the store failed before the call could be sent; it was not sent",
    ),
    "instance_lapsed": (errors.StoreUnavailable, LAPSED),
    "settled_while_waiting": (
        errors.StoreUnavailable,
        "the call's receipt was settled while it waited for older calls (a peer took it "
        "for lost); it was not sent",
    ),
}


def blocked_error(blocked: str, resource: str, queue_timeout_s: float) -> errors.GatewayError:
    """What the caller of an admitted call that was not sent is told (`_BLOCKED`)."""
    kind, detail = _BLOCKED[blocked]
    return kind(detail.format(resource=resource, timeout=queue_timeout_s), retry_after=1)


async def take_turn(rule: ResourceRule, resource: str, place: Place) -> None:
    """With `concurrency: serial`, wait for this call's turn (step 3c)."""
    if rule.concurrency == "serial" and not await place.take_turn(rule.queue_timeout_s):
        raise errors.ResourceBusy(
            f"{resource!r} stayed busy for {rule.queue_timeout_s}s", retry_after=1
        )


async def admit(app: web.Application, call: Call, place: Place) -> Admitted | Replayed | Refused:
    """Steps 4 to 6 in one durable store transaction. The fence is registered in the place
    first: whichever of two calls is admitted first, the later one waits for it or is
    refused as stale. Once the fence has advanced, the open sessions of the resource with a
    lower fence on this process are cut (docs/contract.md §15); `clear_to_forward` then
    waits for them to close. A replay reaches no tool: it leaves its place at once (its
    turn, its fence), so that a client slow to read the stored answer holds up no call."""
    place.register(call.fence)
    started = time.perf_counter()
    result = await app[appkeys.STORE].admit(call)
    app[appkeys.METRICS].admission.observe(time.perf_counter() - started)
    if not isinstance(result, Refused) or result.code not in _FENCE_REFUSALS:
        place.cut_below(call.fence)
    if isinstance(result, Replayed):
        place.leave()
    return result


# Refusals at step 4: the fence did not advance. Any other refusal (step 5) advanced it.
_FENCE_REFUSALS = frozenset(get_args(FenceRefusal))


@dataclass(slots=True)
class Exchange:
    """A forwarded call, its outcome recorded (or not: `recorded` False).

    The tool answered: `head` (status, headers, first bytes) and `answer`, the open response
    to read the rest from by `deadline`. It did not: `error`, what the caller is told.
    """

    outcome: Outcome
    recorded: bool
    deadline: float
    head: Head | None = None
    answer: Answer | None = None
    error: errors.GatewayError | None = None


AnswerReader = Callable[[Answer, float, float], Awaitable[tuple[Head, Outcome]]]
"""(answer, deadline, forwarded_at) → what was read of the answer and the outcome it gives."""


async def read_plain_answer(
    rule: ResourceRule, answer: Answer, deadline: float, forwarded_at: float
) -> tuple[Head, Outcome]:
    """docs/contract.md §3: the status decides; an answer that fits is kept for replay."""
    head = await read_head(answer, rule.idempotency.replay_max_bytes, deadline)
    return head, head.outcome(forwarded_at)


def forward(
    app: web.Application,
    flow: Flow,
    place: Place,
    body: bytes | None,
    client: web.Request | None,
    read_answer: AnswerReader | None = None,
) -> Forwarding:
    """From a durable `pending` receipt to a recorded outcome: `async with forward(...) as
    exchange`.

    `client` is the request being proxied (its headers go on, X-Forwarded-* are set), None
    for a call the gateway makes itself. The receipt counts as in flight here until the
    exchange closes, so the sweeper never takes it for lost. `read_answer` reads the answer
    up to what decides its outcome (an MCP tool call's JSON-RPC answer, §16); by default the
    status decides.
    """
    return Forwarding(app, flow, place, body, client, read_answer)


class Forwarding:
    """`forward`'s context: the exchange on entry; on exit the tool's answer is let go (its
    connection back to the pool, or closed) and the receipt no longer counts as in flight.
    (A class, not an `asynccontextmanager`: every admitted call goes through it, and a
    generator's frame, its loop hooks and contextlib's wrapper cost a call more than this.)"""

    __slots__ = (
        "_answer",
        "_app",
        "_body",
        "_client",
        "_flow",
        "_in_flight",
        "_place",
        "_read_answer",
        "_receipt_id",
    )

    def __init__(
        self,
        app: web.Application,
        flow: Flow,
        place: Place,
        body: bytes | None,
        client: web.Request | None,
        read_answer: AnswerReader | None,
    ) -> None:
        self._app, self._flow, self._place = app, flow, place
        self._body, self._client, self._read_answer = body, client, read_answer
        self._in_flight = app[appkeys.IN_FLIGHT]
        self._answer: Answer | None = None
        self._receipt_id = ""

    async def __aenter__(self) -> Exchange:
        flow = self._flow
        rule, upstream, call, admitted = flow.rule, flow.upstream, flow.call, flow.admitted
        if rule is None or upstream is None or call is None or admitted is None:
            raise ValueError("forward needs an admitted flow")
        self._receipt_id = admitted.receipt_id
        self._in_flight.add(self._receipt_id)
        try:
            return await self._exchange(rule, upstream, call, admitted)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise

    async def __aexit__(self, *exc: object) -> None:
        if self._answer is not None:
            self._answer.release()
        self._in_flight.discard(self._receipt_id)

    def _upstream_done(
        self, upstream: Upstream, forwarded_at: float, outcome: Outcome, failpoints: Failpoints
    ) -> None:
        """The call is back from its tool, answered or not: its time there and its outcome go
        to the flow and the metrics, before the outcome is recorded."""
        flow, metrics = self._flow, self._app[appkeys.METRICS]
        flow.upstream_s = time.time() - forwarded_at
        metrics.upstream_of(upstream.name).observe(flow.upstream_s)
        failpoints.crash_at("after_upstream")
        flow.outcome = outcome.status
        if outcome.status == "outcome_unknown":
            metrics.outcome_unknown.labels(upstream.name).inc()

    async def _exchange(
        self, rule: ResourceRule, upstream: Upstream, call: Call, admitted: Admitted
    ) -> Exchange:
        app, flow, place = self._app, self._flow, self._place
        receipt_id = admitted.receipt_id
        store, failpoints = app[appkeys.STORE], app[appkeys.FAILPOINTS]
        loop = asyncio.get_running_loop()
        failpoints.crash_at("after_admit")
        blocked = await clear_to_forward(place, rule.queue_timeout_s, store, call, admitted)
        # A process paused past its heartbeat sends nothing (docs/contract.md §14, "A replica
        # fences itself"): asked here, before a connection is taken, and once more when one is
        # in hand (`may_send`), the last moment before the bytes leave. A lapse is also why
        # peers settle a waiting call's receipt: it is named as the reason then.
        if blocked in (None, "settled_while_waiting") and not store.may_forward(admitted.instance):
            blocked = "instance_lapsed"
        if blocked is not None:
            outcome = Outcome("not_sent", error=blocked)
            flow.outcome = outcome.status
            error = blocked_error(blocked, call.resource, rule.queue_timeout_s)
            return Exchange(
                outcome, await record(app, receipt_id, outcome), loop.time(), error=error
            )
        sent = upstream_headers(
            self._client,
            upstream,
            _FENCED_DROP,
            admitted_headers(
                rule, call.resource, call.fence, call.idempotency_key, receipt_id, flow.request_id
            ),
            app[appkeys.SETTINGS].trusted_networks,
        )
        if self._read_answer is not None:
            # the gateway reads this answer's body for its outcome (an MCP tool call's
            # JSON-RPC answer, docs/contract.md §16): it cannot read one the tool compressed
            # because the client accepts gzip (httpx and httpx2 always do)
            sent["Accept-Encoding"] = "identity"
        deadline = loop.time() + upstream.timeout_s
        forwarded_at = time.time()
        try:
            answer = await app[appkeys.UPSTREAMS].send(
                upstream,
                call.method,
                flow.rest,
                sent,
                self._body,
                deadline,
                may_send=lambda: store.may_forward(admitted.instance),
            )
        except UpstreamFailure as failure:
            outcome = failure.as_outcome(forwarded_at)
            self._upstream_done(upstream, forwarded_at, outcome, failpoints)
            recorded = await record(app, receipt_id, outcome)
            return Exchange(outcome, recorded, deadline, error=failure.error)
        self._answer = answer  # let go on exit, whatever happens from here on
        if self._read_answer is None:
            head, outcome = await read_plain_answer(rule, answer, deadline, forwarded_at)
        else:
            head, outcome = await self._read_answer(answer, deadline, forwarded_at)
        flow.status = head.status
        self._upstream_done(upstream, forwarded_at, outcome, failpoints)
        recorded = await _record_over(app, place, receipt_id, outcome, over=head.complete)
        return Exchange(outcome, recorded, deadline, head=head, answer=answer)


async def _record_over(
    app: web.Application, place: Place, receipt_id: str, outcome: Outcome, *, over: bool
) -> bool:
    """Record the outcome of a call the tool has answered; when the exchange is `over` (the
    whole answer read), the resource's next serial call may go once the outcome is on its
    way: ahead of the next call's admission where the store commits writes in order, else
    recorded (on a shared store the next call would find this one still pending and wait for
    it there). Relaying the answer to the client holds up no one (docs/contract.md §3,
    "Ordering on takeover": forwarded one at a time)."""
    if not over:
        return await record(app, receipt_id, outcome)
    if app[appkeys.STORE].writes_in_order:
        # the next call resumes once this one yields, which is in the committer's queue
        place.release_turn()
        return await record(app, receipt_id, outcome)
    recorded = await record(app, receipt_id, outcome)
    place.release_turn()
    return recorded


async def record(app: web.Application, receipt_id: str, outcome: Outcome) -> bool:
    """Write the outcome before the answer goes back; False when the store would not."""
    if app[appkeys.FAILPOINTS].fails("after_upstream"):
        return False
    try:
        completion = await app[appkeys.STORE].complete(receipt_id, outcome)
    except errors.StoreUnavailable as exc:
        logs.event("outcome_unrecorded", logging.ERROR, receipt_id=receipt_id, error=str(exc))
        return False
    if completion is Completion.LATE_OUTCOME:
        logs.event(
            "late_outcome",
            logging.ERROR,
            receipt_id=receipt_id,
            detail="an outcome arrived for a receipt already reconciled",
        )
    return True
