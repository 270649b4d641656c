"""The lease API (docs/contract.md §6): the gateway as the issuer of leases and their fences.

Each handler validates everything it is given (problem+json `400` for any bad input), looks
up the resource's lease settings (the first rule with a `gateway` issuer that covers it, else
`403 resource_not_allowed`), and makes one store call: the compare-and-swap lives in the
store, never here. Who may call what is `auth`'s business; the store ties a lease to the
client that acquired it, which is what `not_lease_holder` checks.
"""

from __future__ import annotations

import math
import time
from typing import Any

from aiohttp import web

from gateway.api import params
from gateway.config.policy import ResourceRule
from gateway.core import errors, grammar
from gateway.core.floors import FencesExhausted
from gateway.core.leases import LEASE_STATES, SWEEPER_OWNER_PREFIX
from gateway.core.times import rfc3339
from gateway.observe import logs
from gateway.proxy import appkeys, headers
from gateway.proxy.flow import Flow
from gateway.upkeep import sweeper
from gateway.upkeep.cleanup import Cleaner

_NUMBER = (int, float)

routes = web.RouteTableDef()


@routes.post("/_gateway/v1/leases/{resource:.+}")
async def acquire(request: web.Request) -> web.Response:
    params.only(request, ())
    resource, rule = _resource(request)
    key = headers.parse_idempotency_key(request.headers)
    body = await params.json_body(request, {"owner": str, "ttl_s": _NUMBER}, ("owner",))
    owner = _owner(body["owner"])
    if owner.startswith(SWEEPER_OWNER_PREFIX):
        raise errors.InvalidRequest(
            f"owner names starting with {SWEEPER_OWNER_PREFIX!r} belong to the gateway's sweeper"
        )
    ttl_s = _ttl(body, rule)
    app = request.app
    metrics = app[appkeys.METRICS]
    try:
        taken = await app[appkeys.STORE].acquire(
            resource,
            owner,
            ttl_s,
            rule.lease.lock_delay_s,
            client=_client(request),
            acquire_key=key,
        )
    except FencesExhausted:
        raise errors.ResourceNotAllowed(
            f"the fences of {resource!r} are used up: its highest fence is the largest there "
            f"is ({grammar.MAX_FENCE}), so no new lease can be issued on it"
        ) from None
    lease = taken.lease
    _held(app, taken.held_seconds)  # took over an expired lease not yet marked expired
    if taken.result == "held":
        metrics.acquisitions.labels("conflict").inc()
        free_at = lease.expires_at + rule.lease.lock_delay_s
        why = (
            f"its lease expired, and its lock delay of {rule.lease.lock_delay_s}s has not"
            if lease.state != "held"
            else "it is held until its lease expires or is released"
        )
        raise errors.LeaseHeld(
            f"{resource!r} cannot be taken yet: {why} (also for its own owner name: only a "
            "retry with the same Idempotency-Key gets that lease)",
            retry_after=max(1, math.ceil(free_at - time.time())),
            holder=lease.owner,
            expires_at=rfc3339(lease.expires_at),
        )
    if taken.result == "retried":
        return web.json_response(lease.to_json(), status=200)
    metrics.acquisitions.labels("acquired").inc()
    return web.json_response(lease.to_json(), status=201)


@routes.put("/_gateway/v1/leases/{resource:.+}")
async def renew(request: web.Request) -> web.Response:
    params.only(request, ())
    resource, rule = _resource(request)
    body = await params.json_body(
        request, {"owner": str, "fence": int, "ttl_s": _NUMBER}, ("owner", "fence")
    )
    owner = _owner(body["owner"])
    fence = _fence(body["fence"])
    ttl_s = _ttl(body, rule)
    metrics = request.app[appkeys.METRICS]
    lease = await request.app[appkeys.STORE].renew(resource, owner, fence, ttl_s, _client(request))
    if lease is None:
        metrics.renewals.labels("lost").inc()
        raise errors.LeaseLost(
            f"this lease on {resource!r} is no longer held: it expired, "
            "was released, or belongs to another owner"
        )
    metrics.renewals.labels("renewed").inc()
    return web.json_response(lease.to_json())


@routes.delete("/_gateway/v1/leases/{resource:.+}")
async def release(request: web.Request) -> web.Response:
    """Release (`?owner=&fence=`) or, with `?force=true`, revoke."""
    query = params.only(request, ("owner", "fence", "force"))
    resource, _rule = _resource(request)
    force = query.get("force", "false")
    if force not in ("true", "false"):
        raise errors.InvalidRequest(f"force {force!r}: true or false")
    if force == "true":
        if "owner" in query or "fence" in query:
            raise errors.InvalidRequest("a revoke (force=true) takes no owner or fence")
        await revoke(request.app, resource, _client(request))
        return web.Response(status=204)
    if "owner" not in query or "fence" not in query:
        raise errors.InvalidRequest("a release needs ?owner=…&fence=… (or force=true to revoke)")
    owner = _owner(query["owner"])
    fence = grammar.fence_value(query["fence"])
    if fence is None:
        raise errors.InvalidRequest(
            f"fence {query['fence']!r}: a whole number from 1 to {grammar.MAX_FENCE}"
        )
    released = await request.app[appkeys.STORE].release(resource, owner, fence, _client(request))
    if not released.ok:
        raise errors.LeaseLost(f"this lease on {resource!r} is not the current one")
    _held(request.app, released.held_seconds)
    return web.Response(status=204)


async def revoke(app: web.Application, resource: str, client: str | None) -> None:
    """An admin ends whoever's lease on `resource` (docs/contract.md §6): the API's
    `DELETE ?force=true` and the console's revoke button both come here. The resource must be
    one a rule issues leases for (`lease_rule`)."""
    lease_rule(app, resource)
    # a lease past its expiry owes its on_expiry cleanup (§9) whether or not the sweeper has
    # marked it yet: marked as the sweeper would, the revoke frees it (`free`), where it
    # released it as a live one and its cleanup was never owed
    await sweeper.expire_leases(app, Cleaner(app))
    released = await app[appkeys.STORE].release(resource, None, None)
    _held(app, released.held_seconds)
    logs.event("lease_revoked", resource=resource, client=client, action=released.action)


@routes.get("/_gateway/v1/leases/{resource:.+}")
async def get_lease(request: web.Request) -> web.Response:
    params.only(request, ())
    resource, _rule = _resource(request)
    lease = await request.app[appkeys.STORE].get_lease(resource)
    if lease is None:
        raise errors.NotFound(f"no lease was ever taken on {resource!r}")
    return web.json_response(lease.to_json())


@routes.get("/_gateway/v1/leases")
async def list_leases(request: web.Request) -> web.Response:
    query = params.only(request, ("prefix", "state", "limit", "cursor"))
    state = query.get("state")
    if state is not None and state not in LEASE_STATES:
        raise errors.InvalidRequest(f"state {state!r}: one of {sorted(LEASE_STATES)}")
    size = params.limit(query)
    items = await request.app[appkeys.STORE].list_leases(
        query.get("prefix") or None, state, params.decode_cursor(query), size
    )
    end = items[-1].resource if items else None
    return web.json_response(params.page([lease.to_json() for lease in items], size, end))


# -- validation ------------------------------------------------------------------------------


def _resource(request: web.Request) -> tuple[str, ResourceRule]:
    resource = request.match_info["resource"]
    # problems name the resource (docs/contract.md §5); the log line shows it
    request[appkeys.FLOW] = Flow(request[appkeys.REQUEST_ID], resource=resource)
    return resource, lease_rule(request.app, resource)


def lease_rule(app: web.Application, resource: str) -> ResourceRule:
    """The rule that issues `resource`'s leases; `400`/`403` when it is none."""
    rule = app[appkeys.POLICIES].lease_rule(headers.check_resource(resource))
    if rule is None:
        raise errors.ResourceNotAllowed(
            f"no resource rule with a gateway-issued lease covers {resource!r}"
        )
    return rule


def _owner(value: str) -> str:
    if not grammar.valid_owner(value):
        raise errors.InvalidRequest(f"owner {value!r}: 1 to 128 of A-Z a-z 0-9 . _ - : @ /")
    return value


def _fence(value: int) -> int:
    if not 1 <= value <= grammar.MAX_FENCE:
        raise errors.InvalidRequest(
            f"fence {value!r}: a whole number from 1 to {grammar.MAX_FENCE}"
        )
    return value


def _ttl(body: dict[str, Any], rule: ResourceRule) -> float:
    if "ttl_s" not in body:
        return rule.lease.ttl_s
    maximum = rule.lease.max_ttl_s
    try:
        ttl_s = float(body["ttl_s"])
    except OverflowError:  # an integer too large for a float
        ttl_s = math.inf
    if not math.isfinite(ttl_s) or not 0 < ttl_s <= maximum:
        raise errors.InvalidRequest(
            f"ttl_s {body['ttl_s']!r}: more than 0 and at most {maximum} "
            "(this resource's lease.max_ttl_s)"
        )
    return ttl_s


def _held(app: web.Application, seconds: float | None) -> None:
    """fence_gateway_lease_held_seconds, when a lease ended here (released, revoked, or an
    expired one taken over)."""
    if seconds is not None:
        app[appkeys.METRICS].held.observe(max(0.0, seconds))


def _client(request: web.Request) -> str | None:
    """The authenticated client's name; None when the gateway runs open."""
    client = request.get(appkeys.CLIENT)
    return client.name if client is not None else None
