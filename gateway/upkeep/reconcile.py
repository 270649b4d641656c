"""Reconciling lost outcomes (docs/contract.md §7): when a receipt may be resolved, and the
policy's probe.

A receipt is `outcome_unknown` when the gateway cannot tell whether the tool acted. Someone
who can tell resolves it: an operator or a reconciler service by decision (`resolve`), or the
gateway itself by asking the tool (`probe`). Both go through `resolve` here, so the store's
atomic check (still `outcome_unknown`, past its grace) guards both the same way.

The probe is the one call the gateway makes on its own initiative. It is a read the policy
declares (`probe: {method, path}`), sent once through the upstream's own session, with no
receipt of its own and no idempotency key header (an idempotency layer in the tool could take
a GET carrying the key of a POST for a reused key). Only an unambiguous answer becomes a
resolution: 2xx means the tool holds a record of the operation (`applied`), 404 means it holds
none (`not_applied`). Anything else, a 5xx, a redirect, a broken connection, leaves the
receipt unknown for a person to decide.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from gateway.core import errors
from gateway.core.receipts import ReconcileWaits, Resolution, may_resolve
from gateway.core.times import rfc3339
from gateway.observe import logs
from gateway.proxy import appkeys, headers
from gateway.proxy.relay import upstream_headers
from gateway.proxy.upstream import UpstreamFailure
from gateway.store.base import Receipt, ResolveRefused

PROBE_SOURCE = "policy:probe"
# The metric label is the part of `source` before ':'; anything but these kinds is counted as
# "other", so a free-text source cannot blow up the metric's label set.
SOURCE_KINDS = frozenset({"operator", "policy", "service"})


def wait_times(app: web.Application) -> ReconcileWaits:
    """Per upstream, how long after `forwarded_at` a call may still be running at its tool.
    Receipts of an upstream no longer in the policies wait the longest of them."""
    grace = app[appkeys.SETTINGS].reconcile_grace_s
    policies = app[appkeys.POLICIES]
    waits = {name: u.timeout_s + grace for name, u in policies.upstreams.items()}
    queued = {
        name: max((rule.queue_timeout_s for rule in rules), default=0.0)
        for name, rules in policies.rules_of.items()
    }
    return ReconcileWaits(waits, max(waits.values(), default=30.0), queued)


def why_not_reconcilable(receipt: Receipt, waits: ReconcileWaits, now: float) -> str | None:
    """Why `receipt` cannot be reconciled now, in words for the operator; None when it can."""
    if receipt.status == "reconciled":
        resolution = receipt.resolution or {}
        return (
            f"receipt {receipt.id} is already reconciled "
            f"({resolution.get('outcome')} by {resolution.get('source')})"
        )
    if receipt.status != "outcome_unknown":
        return (
            f"receipt {receipt.id} is {receipt.status}: only outcome_unknown receipts are "
            "reconciled"
        )
    ready_at = waits.ready_at(receipt.upstream, receipt.forwarded_at, receipt.created_at)
    if not may_resolve(receipt.status, ready_at, now):
        return (
            f"receipt {receipt.id} may still be running upstream: it is reconcilable "
            f"from {rfc3339(ready_at)} (forwarded_at + the upstream's timeout_s + "
            "GATEWAY_RECONCILE_GRACE_S)"
        )
    return None


def metric_source(source: str) -> str:
    kind = source.partition(":")[0]
    return kind if kind in SOURCE_KINDS else "other"


async def resolve(
    app: web.Application, receipt_id: str, outcome: Resolution, source: str, note: str | None
) -> Receipt:
    """Reconcile the receipt atomically in the store; NotFound/NotReconcilable otherwise."""
    store = app[appkeys.STORE]
    waits = wait_times(app)
    result = await store.resolve(receipt_id, outcome, source, note, waits)
    if result is ResolveRefused.NOT_FOUND:
        raise errors.NotFound(f"no receipt {receipt_id!r}")
    if isinstance(result, ResolveRefused):
        current = await store.get_receipt(receipt_id)
        detail = why_not_reconcilable(current, waits, time.time()) if current else None
        raise errors.NotReconcilable(detail or f"receipt {receipt_id} is not reconcilable")
    app[appkeys.METRICS].reconciliations.labels(outcome, metric_source(source)).inc()
    logs.event(
        "receipt_reconciled",
        receipt_id=receipt_id,
        resource=result.resource,
        fence=result.fence,
        upstream=result.upstream,
        outcome=outcome,
        source=source,
    )
    return result


async def get_reconcilable(app: web.Application, receipt_id: str) -> Receipt:
    """The receipt if it could be resolved now, else NotFound/NotReconcilable."""
    receipt = await app[appkeys.STORE].get_receipt(receipt_id)
    if receipt is None:
        raise errors.NotFound(f"no receipt {receipt_id!r}")
    detail = why_not_reconcilable(receipt, wait_times(app), time.time())
    if detail is not None:
        raise errors.NotReconcilable(detail)
    return receipt


async def probe(app: web.Application, receipt_id: str) -> dict[str, Any]:
    """Ask the tool what became of the receipt's call; resolve it when the answer is clear.

    The answer is the receipt; when it stays unknown, with `"probe": {"status": N}` (and
    `"error"`, status null, when the probe itself could not get an answer).
    """
    receipt = await get_reconcilable(app, receipt_id)
    upstream = app[appkeys.POLICIES].upstreams.get(receipt.upstream)
    rule = app[appkeys.POLICIES].rule_for(receipt.upstream, receipt.resource)
    if upstream is None or rule is None or rule.probe is None:
        raise errors.NotReconcilable(
            f"the policy has no probe for receipt {receipt_id} (upstream "
            f"{receipt.upstream}, resource {receipt.resource!r}): resolve it instead"
        )
    template = rule.probe
    if receipt.idempotency_key is None and "{idempotency_key}" in template.path:
        # the probe would ask about no operation in particular (a session has no key)
        raise errors.NotReconcilable(
            f"receipt {receipt_id} has no idempotency key for the policy's probe to ask "
            "about: resolve it instead"
        )
    request_id = headers.new_request_id()
    # the tool's credentials as on every call, but no key or fence: this is a read
    sent = upstream_headers(
        None,
        upstream,
        frozenset(),
        {headers.RECEIPT_HEADER: receipt_id, headers.REQUEST_ID_HEADER: request_id},
    )
    target = template.render(
        receipt.resource, receipt.fence, receipt.idempotency_key or "", receipt_id
    )
    deadline = asyncio.get_running_loop().time() + upstream.timeout_s
    try:
        answer = await app[appkeys.UPSTREAMS].send(
            upstream, template.method, target, sent, None, deadline
        )
    except UpstreamFailure as failure:
        logs.event(
            "probe_failed",
            logging.WARNING,
            receipt_id=receipt_id,
            upstream=upstream.name,
            request_id=request_id,
            error=failure.error.detail,
        )
        return {**receipt.to_json(), "probe": {"status": None, "error": failure.error.detail}}
    async with answer:
        status = answer.status
    outcome: Resolution | None = (
        "applied" if 200 <= status < 300 else "not_applied" if status == 404 else None
    )
    logs.event(
        "probe_answered",
        receipt_id=receipt_id,
        upstream=upstream.name,
        request_id=request_id,
        status=status,
        outcome=outcome,
    )
    if outcome is None:
        current = await app[appkeys.STORE].get_receipt(receipt_id) or receipt
        return {**current.to_json(), "probe": {"status": status}}
    note = f"probe {template.method} answered {status}"
    return (await resolve(app, receipt_id, outcome, PROBE_SOURCE, note)).to_json()
