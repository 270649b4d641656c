"""The proxied-call handler: route, admit, forward once, record, answer (SPEC 2 and 3)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from dataclasses import dataclass, replace
from hashlib import sha256
from urllib.parse import unquote

from aiohttp import web

from gateway.config.policy import ResourceRule, Upstream
from gateway.core import admission, errors
from gateway.observe import logs
from gateway.proxy import appkeys, headers
from gateway.proxy.ordering import Lane, clear_to_forward
from gateway.proxy.relay import (
    Head,
    fenced_headers,
    read_body,
    read_head,
    stream_back,
    upstream_headers,
)
from gateway.proxy.upstream import UpstreamFailure
from gateway.store.base import Admitted, Call, Outcome, Refused, Rejection, Replayed

# Client headers never passed on for a fenced call: the gateway sets its own key header.
_FENCED_DROP = frozenset({headers.IDEMPOTENCY_HEADER.lower(), headers.REQUEST_ID_HEADER.lower()})
_PLAIN_DROP = frozenset({headers.REQUEST_ID_HEADER.lower()})


@dataclass(slots=True)
class Target:
    """Where a request goes: its upstream, the path after the mount, the target as received."""

    upstream: Upstream
    rest: str      # after the mount, with the query: what the tool is sent and receipts show
    target: str    # path and query as received, mount included: part of the fingerprint


def route(request: web.Request) -> Target:
    """SPEC 2: the static mount table decides; nothing the client says about hosts does."""
    if request.method in ("TRACE", "CONNECT"):
        raise errors.MethodNotAllowed(f"{request.method} is not proxied")
    if "Upgrade" in request.headers:
        raise errors.UpgradeNotSupported("protocol upgrades (WebSocket) are not proxied")
    raw = request.raw_path
    if not raw.startswith("/"):
        raise errors.InvalidRequest("only origin-form request targets (/path) are accepted")
    path, _, _query = raw.partition("?")
    if any(unquote(segment) in (".", "..") for segment in path.split("/")):
        raise errors.InvalidRequest("a path with a '.' or '..' segment is refused")
    found = request.app[appkeys.POLICIES].route(path)
    if found is None:
        raise errors.NoRoute(f"no upstream is mounted at {path}")
    upstream, _ = found
    return Target(upstream, raw[len(upstream.mount):], raw)


async def handle(request: web.Request) -> web.StreamResponse:
    target = route(request)
    request_id = headers.request_id(request.headers) or headers.new_request_id()
    request[appkeys.REQUEST_ID] = request_id
    request[appkeys.LOG_FIELDS] = {"upstream": target.upstream.name}
    policies = request.app[appkeys.POLICIES]
    if request.method in policies.fenced_methods[target.upstream.name]:
        return await _fenced(request, target, request_id)
    return await _plain(request, target, request_id)


async def _plain(request: web.Request, target: Target, request_id: str) -> web.StreamResponse:
    """An unfenced call: no admission, no receipt, the fencing headers stripped."""
    app = request.app
    upstream = target.upstream
    settings = app[appkeys.SETTINGS]
    body = await read_body(request, upstream.max_body_bytes, settings.body_timeout_s)
    sent = upstream_headers(request, upstream, _PLAIN_DROP,
                            {headers.REQUEST_ID_HEADER: request_id}, settings.trusted_networks)
    deadline = asyncio.get_running_loop().time() + upstream.timeout_s
    try:
        answer = await app[appkeys.UPSTREAMS].send(upstream, request.method, target.rest, sent,
                                                _body_or_none(request, body), deadline)
    except UpstreamFailure as failure:
        raise failure.error from None
    async with answer:
        head = await read_head(answer, 0, deadline)
        response, _ = await stream_back(request, head, answer,
                                        {headers.REQUEST_ID_HEADER: request_id}, deadline)
    return response


async def _fenced(request: web.Request, target: Target, request_id: str) -> web.StreamResponse:
    app = request.app
    settings, store, metrics = app[appkeys.SETTINGS], app[appkeys.STORE], app[appkeys.METRICS]
    upstream = target.upstream
    resource = headers.parse_resource(request.headers)
    client = request.get(appkeys.CLIENT)
    client_name = client.name if client is not None else None
    facts = request[appkeys.LOG_FIELDS]
    facts.update(resource=resource, client=client_name)
    rule = app[appkeys.POLICIES].rule_for(upstream.name, resource)
    refusal = (
        errors.ResourceNotAllowed(f"no resource rule of upstream {upstream.name} matches "
                                  f"{resource!r}") if rule is None
        else errors.Forbidden(f"client {client_name} may not act on {resource!r}")
        if client is not None and not client.covers(resource) else None)
    if refusal is not None:  # step 2 comes before the fence is even looked at
        with contextlib.suppress(errors.GatewayError):
            facts["fence"] = headers.parse_fence(request.headers)
            await _keep_rejection(request, _rejection(request, target, resource,
                                                      facts["fence"], client_name), refusal)
        raise refusal
    facts["fence"] = fence = headers.parse_fence(request.headers)
    rejection = _rejection(request, target, resource, fence, client_name)
    try:
        owner = headers.parse_owner(request.headers)
        rejection = replace(rejection, owner=owner)
        client_key = headers.parse_idempotency_key(request.headers)
        if client_key is None and rule.idempotency.key == "require":
            raise errors.MissingIdempotencyKey("this resource requires an Idempotency-Key")
        body = await read_body(request, upstream.max_body_bytes, settings.body_timeout_s)
    except errors.GatewayError as error:
        await _keep_rejection(request, rejection, error)
        raise

    key = client_key or _make_key(rule, resource, request.method, target.target, body)
    call = Call(resource=resource, fence=fence, owner=owner, client=client_name,
                upstream=upstream.name, method=request.method, path=target.rest,
                issuer=rule.lease.issuer, idempotency_key=key,
                fingerprint=admission.fingerprint(request.method, target.target, body),
                retry_statuses=rule.idempotency.retry_statuses,
                retention_s=rule.idempotency.retention_s,
                clients_configured=app[appkeys.CLIENTS] is not None)

    async with app[appkeys.LANES].lane(resource) as lane:
        if rule.concurrency == "serial" and not await lane.take_turn(rule.queue_timeout_s):
            busy = errors.ResourceBusy(f"{resource!r} stayed busy for {rule.queue_timeout_s}s",
                                       retry_after=1)
            await _keep_rejection(request, rejection, busy)
            raise busy
        try:
            _check_signature(request, rule, resource, fence)
        except errors.GatewayError as error:
            await _keep_rejection(request, rejection, error)
            raise
        if request.transport is None or request.transport.is_closing():
            raise errors.InvalidRequest("the client went away before admission")  # nobody hears
        lane.register(fence)
        started = time.perf_counter()
        result = await store.admit(call)
        metrics.admission.observe(time.perf_counter() - started)
        if isinstance(result, Refused):
            raise _refusal(result)
        if isinstance(result, Replayed):
            return await _replay(request, result, request_id, key, fence)
        return await _forward(request, target, rule, call, body, result, lane, request_id)


async def _forward(request: web.Request, target: Target, rule: ResourceRule, call: Call,
                   body: bytes, admitted: Admitted, lane: Lane,
                   request_id: str) -> web.StreamResponse:
    """From a durable `pending` receipt to a recorded outcome and the answer."""
    app = request.app
    store, metrics, failpoints = app[appkeys.STORE], app[appkeys.METRICS], app[appkeys.FAILPOINTS]
    upstream = target.upstream
    receipt_id = admitted.receipt_id
    request[appkeys.LOG_FIELDS].update(receipt_id=receipt_id)
    answer_headers = {headers.RECEIPT_HEADER: receipt_id, headers.REQUEST_ID_HEADER: request_id,
                      headers.IDEMPOTENCY_HEADER: call.idempotency_key,
                      headers.FENCE_HEADER: str(call.fence)}
    in_flight = app[appkeys.IN_FLIGHT]
    in_flight.add(receipt_id)
    try:
        failpoints.crash_at("after_admit")
        blocked = await clear_to_forward(lane, rule.queue_timeout_s, store, receipt_id)
        if blocked is not None:
            await _record(request, receipt_id, Outcome("not_sent", error=blocked))
            raise errors.from_code(blocked, _BLOCKED_DETAIL[blocked].format(
                resource=call.resource, timeout=rule.queue_timeout_s),
                retry_after=1, headers=answer_headers)
        sent = fenced_headers(rule, call.resource, call.fence, call.idempotency_key,
                              receipt_id, request_id)
        upstream_sent = upstream_headers(request, upstream, _FENCED_DROP, sent,
                                         app[appkeys.SETTINGS].trusted_networks)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + upstream.timeout_s
        forwarded_at = time.time()
        try:
            answer = await app[appkeys.UPSTREAMS].send(
                upstream, call.method, target.rest, upstream_sent,
                _body_or_none(request, body), deadline)
        except UpstreamFailure as failure:
            metrics.upstream.labels(upstream.name).observe(time.time() - forwarded_at)
            failpoints.crash_at("after_upstream")
            outcome = failure.as_outcome(forwarded_at)
            if failure.outcome == "outcome_unknown":
                metrics.outcome_unknown.labels(upstream.name).inc()
            unrecorded = not await _record(request, receipt_id, outcome)
            failure.error.headers.update(answer_headers)
            if unrecorded:
                failure.error.headers["X-Receipt-Outcome"] = "unrecorded"
            raise failure.error from None
        async with answer:
            head = await read_head(answer, rule.idempotency.replay_max_bytes, deadline)
            metrics.upstream.labels(upstream.name).observe(time.time() - forwarded_at)
            failpoints.crash_at("after_upstream")
            recorded = await _record(request, receipt_id, head.outcome(forwarded_at))
            if not recorded:
                answer_headers["X-Receipt-Outcome"] = "unrecorded"
            response, broke = await stream_back(request, head, answer, answer_headers, deadline)
        if broke and not head.broken:
            await _quietly(store.mark_incomplete(receipt_id))
        request[appkeys.LOG_FIELDS].update(status=head.status)
        return response
    finally:
        in_flight.discard(receipt_id)


async def _record(request: web.Request, receipt_id: str, outcome: Outcome) -> bool:
    """Write the outcome before the answer goes back; False when the store would not."""
    if request.app[appkeys.FAILPOINTS].fails("after_upstream"):
        return False
    try:
        result = await request.app[appkeys.STORE].complete(receipt_id, outcome)
    except errors.StoreUnavailable as exc:
        logs.event("outcome_unrecorded", logging.ERROR, receipt_id=receipt_id, error=str(exc))
        return False
    if result == "late_outcome":
        logs.event("late_outcome", logging.ERROR, receipt_id=receipt_id,
                   detail="an outcome arrived for a receipt already reconciled")
    return True


async def _keep_rejection(request: web.Request, rejection: Rejection,
                          error: errors.GatewayError) -> None:
    """Leave a `rejected` receipt; if the store is down the client still gets `error`."""
    app = request.app
    kept = replace(rejection, code=error.code, http_status=error.status)
    receipt_id = await _quietly(app[appkeys.STORE].reject(kept))
    if receipt_id:
        error.headers[headers.RECEIPT_HEADER] = receipt_id


async def _quietly(awaitable: object) -> object:
    try:
        return await awaitable  # type: ignore[misc]
    except errors.StoreUnavailable as exc:
        logs.event("store_write_failed", logging.WARNING, error=str(exc))
        return None


def _refusal(refused: Refused) -> errors.GatewayError:
    """Admission said no: the problem names the receipt to look at (`receipt_id`) for an
    idempotency refusal; X-Receipt-Id is the `rejected` receipt this call left."""
    extra = {"receipt_id": refused.holder_receipt_id} if refused.holder_receipt_id else {}
    return errors.from_code(
        refused.code, _REFUSAL_DETAIL.get(refused.code),
        retry_after=1 if refused.code == "idempotency_in_flight" else None,
        headers={headers.RECEIPT_HEADER: refused.receipt_id}, **extra)


_BLOCKED_DETAIL = {
    "resource_busy": "older calls of {resource!r} stayed in flight for {timeout}s",
    "store_unavailable": "the store failed before the call could be sent; it was not sent",
}

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


async def _replay(request: web.Request, replayed: Replayed, request_id: str, key: str,
                  fence: int) -> web.StreamResponse:
    """The stored answer, as the tool gave it, marked as a replay."""
    request[appkeys.REPLAYED] = True
    head = Head(replayed.status, replayed.headers, replayed.body, complete=True, broken=False)
    response, _ = await stream_back(request, head, None, {
        "Idempotent-Replayed": "true", headers.RECEIPT_HEADER: replayed.receipt_id,
        headers.REQUEST_ID_HEADER: request_id, headers.IDEMPOTENCY_HEADER: key,
        headers.FENCE_HEADER: str(fence)},
        # a stored answer is small (replay_max_bytes): the body timeout is ample to send it
        deadline=asyncio.get_running_loop().time() + request.app[appkeys.SETTINGS].body_timeout_s)
    return response


def _check_signature(request: web.Request, rule: ResourceRule, resource: str, fence: int) -> None:
    env = rule.lease.hmac_secret_env
    if rule.lease.issuer != "external" or not env:
        return
    presented = headers.parse_signature(request.headers) or ""
    secret = request.app[appkeys.POLICIES].hmac_secrets[env]
    expected = hmac.new(secret, f"{resource}\n{fence}".encode(), sha256).hexdigest()
    # surrogateescape: header bytes that are not UTF-8 compare unequal instead of failing
    if not hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), expected.encode()):
        raise errors.BadFenceSignature("X-Fence-Signature is missing or wrong")


def _make_key(rule: ResourceRule, resource: str, method: str, target: str, body: bytes) -> str:
    if rule.idempotency.key == "random":
        return admission.random_key()
    return admission.derived_key(resource, method, target, body)


def _body_or_none(request: web.Request, body: bytes) -> bytes | None:
    """Send a body only when the client framed one: a bare GET stays without Content-Length."""
    framed = request.content_length is not None or "Transfer-Encoding" in request.headers
    return body if framed or body else None


def _rejection(request: web.Request, target: Target, resource: str, fence: int,
               client: str | None) -> Rejection:
    """What a `rejected` receipt records once resource and fence are readable."""
    return Rejection(resource=resource, fence=fence, owner=None, client=client,
                     upstream=target.upstream.name, method=request.method, path=target.rest,
                     code="", http_status=0)

