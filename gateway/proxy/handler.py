"""The proxied-call handler: route, check, admit, forward once, answer (docs/contract.md §2,
§3).

A fenced call's checks run cheapest first (headers, body, signature) and only then does it
wait for a turn; every refusal before admission is kept as a `rejected` receipt
(`checks.keep_rejection`). From admission on, the call takes the one path every admitted
call takes (`gateway.proxy.forward`). A WebSocket upgrade to an upstream that takes them is a
session (`gateway.proxy.sessions`, §15); a CDP discovery answer is rewritten on its way back
(`gateway.proxy.cdp`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from aiohttp import web

from gateway.config.policy import ResourceRule, Upstream
from gateway.core import errors, idempotency
from gateway.observe import logs
from gateway.proxy import appkeys, cdp, checks, headers, mcp, sessions
from gateway.proxy.flow import Flow
from gateway.proxy.forward import admit, forward, take_turn
from gateway.proxy.relay import (
    STREAMED,
    Head,
    framed_body,
    read_body,
    read_head,
    send_unfenced,
    stream_back,
)
from gateway.proxy.route import Route, route
from gateway.store.base import Call, Refused, Replayed


async def handle(request: web.Request) -> web.StreamResponse:
    found = route(request, request.app[appkeys.POLICIES])
    flow = Flow(
        request[appkeys.REQUEST_ID],
        upstream=found.upstream,
        method=request.method,
        rest=found.rest,
        request_target=found.request_target,
    )
    request[appkeys.FLOW] = flow
    tracing = request.app[appkeys.TRACING]  # None, unless GATEWAY_OTEL (docs/contract.md §21)
    if tracing is not None:
        return await tracing.call(request, flow, lambda: _dispatch(request, flow, found))
    return await _dispatch(request, flow, found)


def _dispatch(request: web.Request, flow: Flow, found: Route) -> Awaitable[web.StreamResponse]:
    """The path the call takes: its coroutine, for the caller to await (one frame fewer in
    the stack every wait of the call resumes)."""
    if found.websocket:
        return sessions.handle(request, flow, found.upstream)
    if found.upstream.mcp:  # fenced per tool call, not per method (docs/contract.md §16)
        return mcp.handle(request, flow, found.upstream)
    if request.method in request.app[appkeys.POLICIES].fenced_methods[found.upstream.name]:
        return _fenced(request, flow, found.upstream)
    return _plain(request, flow, found.upstream)


async def _plain(request: web.Request, flow: Flow, upstream: Upstream) -> web.StreamResponse:
    """An unfenced call: no admission, no receipt, the fencing headers stripped."""
    settings = request.app[appkeys.SETTINGS]
    body = await read_body(request, upstream.max_body_bytes, settings.body_timeout_s)
    answer, deadline = await send_unfenced(request, flow, upstream, body)
    discovery = cdp.is_discovery(upstream, request.method, flow.rest)
    async with answer:
        head = await read_head(answer, cdp.DISCOVERY_MAX_BYTES if discovery else STREAMED, deadline)
        if discovery:
            head = cdp.rewrite_head(head, cdp.public_base(request, upstream, settings), upstream)
        response, _ = await stream_back(
            request, head, answer, {headers.REQUEST_ID_HEADER: flow.request_id}, deadline
        )
    return response


async def _fenced(request: web.Request, flow: Flow, upstream: Upstream) -> web.StreamResponse:
    app = request.app
    rule, call, body = await _checked(request, flow, upstream)
    # the place is held until the call's outcome is recorded
    async with app[appkeys.LANES].join(call.resource) as place:
        try:  # step 3c
            await take_turn(rule, call.resource, place)
        except errors.GatewayError as busy:
            await checks.keep_rejection(request, flow, busy)
            raise
        if request.transport is None or request.transport.is_closing():
            # nobody hears the answer: the call is not admitted, so nothing is forwarded
            raise errors.InvalidRequest("the client went away before admission")
        result = await admit(app, call, place)
        if isinstance(result, Refused):
            raise checks.error_for(result)
        if isinstance(result, Replayed):
            return await _replay(request, flow, result)
        flow.admitted = result
        answer_headers = flow.answer_headers(result.receipt_id)
        async with forward(app, flow, place, framed_body(request, body), request) as exchange:
            if not exchange.recorded:
                answer_headers["X-Receipt-Outcome"] = "unrecorded"
            if exchange.head is None:
                error = exchange.error or errors.GatewayError()
                error.headers.update(answer_headers)
                raise error
            response, broke = await stream_back(
                request,
                _discovery_rewritten(request, flow, upstream, exchange.head),
                exchange.answer,
                answer_headers,
                exchange.deadline,
            )
        if broke and not exchange.head.broken:
            try:
                await app[appkeys.STORE].mark_incomplete(result.receipt_id)
            except errors.StoreUnavailable as exc:  # the answer is gone; only the log can tell
                logs.event("store_write_failed", logging.WARNING, error=str(exc))
        return response


async def _checked(
    request: web.Request, flow: Flow, upstream: Upstream
) -> tuple[ResourceRule, Call, bytes]:
    """Steps 1 to 3b: the headers, the body and the signature; the rule, the call to admit
    and its body. A refusal here, once resource and fence are readable, is kept as a `rejected`
    receipt."""
    app = request.app
    try:
        rule = checks.rule_of(request, flow, upstream)
        flow.fence = headers.parse_fence(request.headers)
        flow.owner = headers.parse_owner(request.headers)
        client_key = headers.parse_idempotency_key(request.headers)
        if client_key is None and rule.idempotency.key == "require":
            raise errors.MissingIdempotencyKey("this resource requires an Idempotency-Key")
        body = await read_body(
            request, upstream.max_body_bytes, app[appkeys.SETTINGS].body_timeout_s
        )
        checks.check_signature(request, rule, flow)
    except errors.GatewayError as error:
        await checks.keep_rejection(request, flow, error)
        raise
    resource = flow.resource or ""
    key = client_key or _make_key(rule, resource, flow.method, flow.request_target, body)
    call = flow.admission(
        rule,
        key,
        idempotency.fingerprint(flow.method, flow.request_target, body),
        rule.idempotency.retry_statuses,
        app[appkeys.CLIENTS] is not None,
    )
    return rule, call, body


async def _replay(request: web.Request, flow: Flow, replayed: Replayed) -> web.StreamResponse:
    """The stored answer, as the tool gave it, marked as a replay."""
    flow.replayed = True
    head = Head(replayed.status, replayed.headers, replayed.body, complete=True, broken=False)
    response, _ = await stream_back(
        request,
        _discovery_rewritten(request, flow, flow.upstream, head),
        None,
        {"Idempotent-Replayed": "true", **flow.answer_headers(replayed.receipt_id)},
        # a stored answer is small (replay_max_bytes): the body timeout is ample to send it
        deadline=asyncio.get_running_loop().time() + request.app[appkeys.SETTINGS].body_timeout_s,
    )
    return response


def _discovery_rewritten(
    request: web.Request, flow: Flow, upstream: Upstream | None, head: Head
) -> Head:
    """A fenced CDP discovery answer (`PUT /json/new`), its WebSocket URLs pointing at the
    gateway (docs/contract.md §15); the stored answer stays the tool's own."""
    if upstream is None or not cdp.is_discovery(upstream, flow.method, flow.rest):
        return head
    settings = request.app[appkeys.SETTINGS]
    return cdp.rewrite_head(head, cdp.public_base(request, upstream, settings), upstream)


def _make_key(
    rule: ResourceRule, resource: str, method: str, request_target: str, body: bytes
) -> str:
    if rule.idempotency.key == "random":
        return idempotency.random_key()
    return idempotency.derived_key(resource, method, request_target, body)
