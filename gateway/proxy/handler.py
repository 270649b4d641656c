"""The proxied-call handler: route, check, admit, forward once, answer (docs/contract.md §2,
§3).

A fenced call's checks run cheapest first (headers, body, signature) and only then does it
wait for a turn; every refusal before admission is kept as a `rejected` receipt in one place
(`_checked`). From admission on, the call takes the one path every admitted call takes
(`gateway.proxy.forward`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from hashlib import sha256

from aiohttp import web

from gateway.config.policy import ResourceRule, Upstream
from gateway.core import errors, idempotency
from gateway.observe import logs
from gateway.proxy import appkeys, headers
from gateway.proxy.flow import Flow
from gateway.proxy.forward import admit, forward, take_turn
from gateway.proxy.ordering import Place
from gateway.proxy.relay import Head, read_body, read_head, stream_back, upstream_headers
from gateway.proxy.route import route
from gateway.proxy.upstream import UpstreamFailure
from gateway.store.base import Call, Refused, Replayed

_PLAIN_DROP = frozenset({headers.REQUEST_ID_HEADER.lower()})


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
    if request.method in request.app[appkeys.POLICIES].fenced_methods[found.upstream.name]:
        return await _fenced(request, flow, found.upstream)
    return await _plain(request, flow, found.upstream)


async def _plain(request: web.Request, flow: Flow, upstream: Upstream) -> web.StreamResponse:
    """An unfenced call: no admission, no receipt, the fencing headers stripped."""
    app = request.app
    settings = app[appkeys.SETTINGS]
    body = await read_body(request, upstream.max_body_bytes, settings.body_timeout_s)
    sent = upstream_headers(
        request,
        upstream,
        _PLAIN_DROP,
        {headers.REQUEST_ID_HEADER: flow.request_id},
        settings.trusted_networks,
    )
    deadline = asyncio.get_running_loop().time() + upstream.timeout_s
    try:
        answer = await app[appkeys.UPSTREAMS].send(
            upstream, request.method, flow.rest, sent, _body_or_none(request, body), deadline
        )
    except UpstreamFailure as failure:
        raise failure.error from None
    async with answer:
        head = await read_head(answer, 0, deadline)
        response, _ = await stream_back(
            request, head, answer, {headers.REQUEST_ID_HEADER: flow.request_id}, deadline
        )
    return response


async def _fenced(request: web.Request, flow: Flow, upstream: Upstream) -> web.StreamResponse:
    app = request.app
    async with _checked(request, flow, upstream) as (call, body, place):
        if request.transport is None or request.transport.is_closing():
            # nobody hears the answer: the call is not admitted, so nothing is forwarded
            raise errors.InvalidRequest("the client went away before admission")
        result = await admit(app, call, place)
        if isinstance(result, Refused):
            raise _error_for(result)
        if isinstance(result, Replayed):
            return await _replay(request, flow, call, result)
        flow.admitted = result
        answer_headers = {
            headers.RECEIPT_HEADER: result.receipt_id,
            headers.REQUEST_ID_HEADER: flow.request_id,
            headers.IDEMPOTENCY_HEADER: call.idempotency_key,
            headers.FENCE_HEADER: str(call.fence),
        }
        async with forward(app, flow, place, _body_or_none(request, body), request) as exchange:
            if not exchange.recorded:
                answer_headers["X-Receipt-Outcome"] = "unrecorded"
            if exchange.head is None:
                error = exchange.error or errors.GatewayError()
                error.headers.update(answer_headers)
                raise error
            response, broke = await stream_back(
                request, exchange.head, exchange.answer, answer_headers, exchange.deadline
            )
        if broke and not exchange.head.broken:
            try:
                await app[appkeys.STORE].mark_incomplete(result.receipt_id)
            except errors.StoreUnavailable as exc:  # the answer is gone; only the log can tell
                logs.event("store_write_failed", logging.WARNING, error=str(exc))
        return response


@asynccontextmanager
async def _checked(
    request: web.Request, flow: Flow, upstream: Upstream
) -> AsyncIterator[tuple[Call, bytes, Place]]:
    """Steps 1 to 3c: the headers, the body and the signature, then the turn in the
    resource's place. A refusal here, once resource and fence are readable, is kept as a
    `rejected` receipt; the place is held until the call's outcome is recorded."""
    app = request.app
    try:
        rule = _rule(request, flow, upstream)
        flow.fence = headers.parse_fence(request.headers)
        flow.owner = headers.parse_owner(request.headers)
        client_key = headers.parse_idempotency_key(request.headers)
        if client_key is None and rule.idempotency.key == "require":
            raise errors.MissingIdempotencyKey("this resource requires an Idempotency-Key")
        body = await read_body(
            request, upstream.max_body_bytes, app[appkeys.SETTINGS].body_timeout_s
        )
        _check_signature(request, rule, flow)
    except errors.GatewayError as error:
        await _keep_rejection(request, flow, error)
        raise
    resource, fence = flow.resource or "", flow.fence
    key = client_key or _make_key(rule, resource, flow.method, flow.request_target, body)
    call = Call(
        resource=resource,
        fence=fence,
        owner=flow.owner,
        client=flow.client,
        upstream=upstream.name,
        method=flow.method,
        path=flow.rest,
        issuer=rule.lease.issuer,
        idempotency_key=key,
        fingerprint=idempotency.fingerprint(flow.method, flow.request_target, body),
        retry_statuses=rule.idempotency.retry_statuses,
        retention_s=rule.idempotency.retention_s,
        clients_configured=app[appkeys.CLIENTS] is not None,
        serial=rule.concurrency == "serial",
    )
    flow.call = call
    async with app[appkeys.LANES].join(resource) as place:
        try:
            await take_turn(rule, resource, place)
        except errors.GatewayError as error:
            await _keep_rejection(request, flow, error)
            raise
        yield call, body, place


def _rule(request: web.Request, flow: Flow, upstream: Upstream) -> ResourceRule:
    """Step 2: the resource, its rule and the client's scope, before the fence is looked at."""
    flow.resource = resource = headers.parse_resource(request.headers)
    client = request.get(appkeys.CLIENT)
    flow.client = client.name if client is not None else None
    rule = request.app[appkeys.POLICIES].rule_for(upstream.name, resource)
    if rule is None:
        raise errors.ResourceNotAllowed(
            f"no resource rule of upstream {upstream.name} matches {resource!r}"
        )
    if client is not None and not client.covers(resource):
        raise errors.Forbidden(f"client {flow.client} may not act on {resource!r}")
    flow.rule = rule
    return rule


async def _keep_rejection(request: web.Request, flow: Flow, error: errors.GatewayError) -> None:
    """Leave a `rejected` receipt once resource and fence are readable; if the store is down
    the client still gets `error`."""
    if flow.resource is not None and flow.fence is None:
        with contextlib.suppress(errors.GatewayError):  # step 2 failed: the fence, if any
            flow.fence = headers.parse_fence(request.headers)
    rejection = flow.rejection(error.code, error.status)
    if rejection is None:
        return
    try:
        receipt_id = await request.app[appkeys.STORE].reject(rejection)
    except errors.StoreUnavailable as exc:
        logs.event("store_write_failed", logging.WARNING, error=str(exc))
        return
    error.headers[headers.RECEIPT_HEADER] = receipt_id


def _error_for(refused: Refused) -> errors.GatewayError:
    """Admission said no: the problem names the receipt to look at (`receipt_id`) for an
    idempotency refusal; X-Receipt-Id is the `rejected` receipt this call left."""
    extra = {"receipt_id": refused.holder_receipt_id} if refused.holder_receipt_id else {}
    return errors.from_code(
        refused.code,
        _REFUSAL_DETAIL.get(refused.code),
        retry_after=1 if refused.code == "idempotency_in_flight" else None,
        headers={headers.RECEIPT_HEADER: refused.receipt_id},
        **extra,
    )


_REFUSAL_DETAIL = {
    "stale_fence": "the fencing token is older than the resource's current owner",
    "fence_not_issued": "the gateway never issued this fencing token for the resource",
    "lease_expired": "the lease of this fencing token has expired or was released",
    "owner_mismatch": "X-Lease-Owner is not the owner of this lease",
    "not_lease_holder": "this client did not acquire the lease of this fencing token",
    "idempotency_key_reused": "this idempotency key was used for a different call",
    "idempotency_in_flight": "a call with this idempotency key is still in flight",
    "outcome_unknown": "the outcome of the call with this key is unknown: reconcile first",
    "already_completed": "the call with this idempotency key already completed",
}


async def _replay(
    request: web.Request, flow: Flow, call: Call, replayed: Replayed
) -> web.StreamResponse:
    """The stored answer, as the tool gave it, marked as a replay."""
    flow.replayed = True
    head = Head(replayed.status, replayed.headers, replayed.body, complete=True, broken=False)
    response, _ = await stream_back(
        request,
        head,
        None,
        {
            "Idempotent-Replayed": "true",
            headers.RECEIPT_HEADER: replayed.receipt_id,
            headers.REQUEST_ID_HEADER: flow.request_id,
            headers.IDEMPOTENCY_HEADER: call.idempotency_key,
            headers.FENCE_HEADER: str(call.fence),
        },
        # a stored answer is small (replay_max_bytes): the body timeout is ample to send it
        deadline=asyncio.get_running_loop().time() + request.app[appkeys.SETTINGS].body_timeout_s,
    )
    return response


def _check_signature(request: web.Request, rule: ResourceRule, flow: Flow) -> None:
    env = rule.lease.hmac_secret_env
    if rule.lease.issuer != "external" or not env:
        return
    presented = headers.parse_signature(request.headers) or ""
    secret = request.app[appkeys.POLICIES].hmac_secrets[env]
    expected = hmac.new(secret, f"{flow.resource}\n{flow.fence}".encode(), sha256).hexdigest()
    # surrogateescape: header bytes that are not UTF-8 compare unequal instead of failing
    if not hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), expected.encode()):
        raise errors.BadFenceSignature("X-Fence-Signature is missing or wrong")


def _make_key(
    rule: ResourceRule, resource: str, method: str, request_target: str, body: bytes
) -> str:
    if rule.idempotency.key == "random":
        return idempotency.random_key()
    return idempotency.derived_key(resource, method, request_target, body)


def _body_or_none(request: web.Request, body: bytes) -> bytes | None:
    """Send a body only when the client framed one: a bare GET stays without Content-Length."""
    framed = request.content_length is not None or "Transfer-Encoding" in request.headers
    return body if framed or body else None
