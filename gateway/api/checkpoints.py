"""Checkpoints and the run view (docs/contract.md §17): where the owner of a resource had got
to, written only by its current owner, and everything a replacement worker reads to resume.

A checkpoint write runs the checks of a fenced call that concern authority, in §3's order:
the client (its role is `gateway.server.auth`'s, step 1), the resource and its rule (step 2),
the fence and owner headers and the body, then the fence itself (step 4: the signature here,
the fence check in the store's transaction, `gateway.core.checkpoints.decide_write`). A
refusal writes nothing and leaves no receipt: a checkpoint is not a call.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from gateway.api import params
from gateway.config.policy import PolicySet, ResourceRule
from gateway.core import checkpoints, errors
from gateway.core.grammar import MAX_FENCE
from gateway.core.receipts import ReconcileWaits
from gateway.proxy import appkeys, checks, headers
from gateway.proxy.flow import Flow
from gateway.proxy.relay import read_body
from gateway.store.base import CheckpointRefused, CheckpointWritten, RunRecords
from gateway.upkeep.reconcile import wait_times

# Any JSON value, as the body's parser gives it (a JSON true is a bool: named apart).
_ANY_JSON = (dict, list, str, int, float, bool, type(None))
_FIELDS: dict[str, type | tuple[type, ...]] = {"step": str, "state": _ANY_JSON}

# Checkpoints page newest first: a cursor is the `seq` below which the next page starts.
# Every string the pattern admits is a harmless bound (the OpenAPI document states it).
CURSOR_PATTERN = r"^before:(0|[1-9][0-9]{0,18})$"
_CURSOR = re.compile(CURSOR_PATTERN)

routes = web.RouteTableDef()


@routes.put("/_gateway/v1/checkpoints/{resource:.+}")
async def write_checkpoint(request: web.Request) -> web.Response:
    """`201` with the new checkpoint, `200` with the latest for an identical retry."""
    metrics = request.app[appkeys.METRICS]
    try:
        written = await _write(request)
    except errors.GatewayError as error:
        metrics.checkpoints.labels("refused" if error.status < 500 else "error").inc()
        raise
    metrics.checkpoints.labels("written" if written.created else "retried").inc()
    return web.json_response(written.checkpoint.to_json(), status=201 if written.created else 200)


async def _write(request: web.Request) -> CheckpointWritten:
    app = request.app
    params.only(request, ())
    flow, rule = _resource(request, reading=False)
    resource = flow.resource or ""
    flow.fence = headers.parse_fence(request.headers)
    flow.owner = headers.parse_owner(request.headers)
    raw = await read_body(request, checkpoints.MAX_BODY_BYTES, app[appkeys.SETTINGS].body_timeout_s)
    # `state` is kept and measured as the owner wrote it (§17): a whole number written with
    # an exponent stays a number, not an int of 31 digits that a 1e30 would become
    body = params.json_object(raw, _FIELDS, ("step", "state"), parse_float=float)
    try:
        step = checkpoints.checked_step(body["step"])
        state = checkpoints.encoded_state(body["state"])
    except checkpoints.BadCheckpoint as exc:
        raise errors.InvalidRequest(str(exc)) from None
    checks.check_signature(request, rule, flow)
    new = checkpoints.NewCheckpoint(
        resource=resource,
        fence=flow.fence,
        owner=flow.owner,
        client=flow.client,
        step=step,
        state=state,
        retention_s=rule.idempotency.retention_s,
    )
    written = await app[appkeys.STORE].write_checkpoint(
        new, rule.lease.issuer, app[appkeys.CLIENTS] is not None
    )
    if isinstance(written, CheckpointRefused):
        raise errors.from_code(written.code, _REFUSAL_DETAIL.get(written.code))
    return written


_REFUSAL_DETAIL = {
    "stale_fence": "the fencing token is older than the resource's current owner: "
    "nothing was written",
    "fence_not_issued": "the gateway never issued this fencing token for the resource",
    "lease_expired": "the lease of this fencing token has expired or was released",
    "owner_mismatch": "X-Lease-Owner is not the owner of this lease",
    "not_lease_holder": "this client did not acquire the lease of this fencing token",
}


@routes.get("/_gateway/v1/checkpoints/{resource:.+}")
async def list_checkpoints(request: web.Request) -> web.Response:
    query = params.only(request, ("limit", "cursor"))
    flow, _rule = _resource(request, reading=True)
    size = params.limit(query)
    items = await request.app[appkeys.STORE].list_checkpoints(
        flow.resource or "", _before(query), size
    )
    cursor = f"before:{items[-1].seq}" if len(items) == size else None
    return web.json_response({"items": [c.to_json() for c in items], "next_cursor": cursor})


@routes.get("/_gateway/v1/resources/{resource:.+}")
async def run_view(request: web.Request) -> web.Response:
    """Everything a replacement worker needs in one answer."""
    params.only(request, ())
    flow, _rule = _resource(request, reading=True)
    records = await request.app[appkeys.STORE].run_records(flow.resource or "")
    client = request.get(appkeys.CLIENT)
    # An agent is not shown the historical highest fence (docs/contract.md §5): a stale
    # agent that sees a live token will try it.
    agent = client is not None and not client.may("reconciler")
    return web.json_response(
        view_json(flow.resource or "", records, wait_times(request.app), agent)
    )


def view_json(
    resource: str, records: RunRecords, waits: ReconcileWaits, agent: bool
) -> dict[str, Any]:
    """The run view of docs/contract.md §17; `agent`: without `highest_fence`."""
    lease = records.lease
    state = checkpoints.run_state(
        records.unknown_since,
        lease_exists=lease is not None,
        lease_live=lease is not None and lease.state == "held",  # as shown: held is live
        waits=waits,
        now=records.now,
    )
    view: dict[str, Any] = {
        "resource": resource,
        "state": state,
        "lease": lease.to_json() if lease is not None else None,
    }
    if not agent:
        view["highest_fence"] = records.highest_fence
    checkpoint = records.checkpoint
    view["checkpoint"] = checkpoint.to_json() if checkpoint is not None else None
    view["since_checkpoint"] = {
        "completed": [r.to_json() for r in records.completed],
        "needs_confirmation": [r.to_json() for r in records.needs_confirmation],
        "rejected": records.rejected,
    }
    return view


# -- validation ------------------------------------------------------------------------------


def checkpoint_rule(policies: PolicySet, resource: str) -> ResourceRule | None:
    """The rule of a resource's checkpoints (docs/contract.md §17): the one that issues its
    leases, else the first rule in file order that covers it."""
    return policies.lease_rule(resource) or next(
        (rule for rule in policies.rules if rule.covers(resource)), None
    )


def _resource(request: web.Request, *, reading: bool) -> tuple[Flow, ResourceRule]:
    """§3 step 2 for the resource in the path: well formed, covered by a rule, and the
    client's (a reconciler or admin reads every resource)."""
    resource = request.match_info["resource"]
    flow = Flow(request[appkeys.REQUEST_ID], resource=resource)  # problems name it (§5)
    request[appkeys.FLOW] = flow
    headers.check_resource(resource)
    rule = checkpoint_rule(request.app[appkeys.POLICIES], resource)
    if rule is None:
        raise errors.ResourceNotAllowed(f"no resource rule covers {resource!r}")
    client = request.get(appkeys.CLIENT)
    if client is not None:
        flow.client = client.name
        if not (client.covers(resource) or (reading and client.may("reconciler"))):
            raise errors.Forbidden(f"client {client.name} may not use {resource!r}")
    return flow, rule


def _before(query: dict[str, str]) -> int | None:
    value = query.get("cursor")
    if value is None:
        return None
    if not _CURSOR.fullmatch(value):
        raise errors.InvalidRequest(f"cursor {value!r} is not one this gateway gave out")
    return min(int(value.removeprefix("before:")), MAX_FENCE)
