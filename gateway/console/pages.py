"""The pages: overview, reconciliation queue, leases, one resource. Each reads the store
(bounded, `reads`), counts (`tallies`), lays out its charts (`charts`) and renders a template;
none changes anything."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from aiohttp import web

from gateway.console import charts, reads, tallies
from gateway.console.guard import Visit
from gateway.console.render import STATIC
from gateway.core import errors, grammar
from gateway.core.leases import LEASE_STATES, Lease
from gateway.proxy import appkeys, headers
from gateway.store.base import Receipt
from gateway.upkeep import reconcile

HOUR = 3600.0
BUCKETS = 12  # the overview's hour in five-minute bars
RECEIPTS_SHOWN = 100  # the newest receipts listed on a resource page
# Where a queue page goes on (`ReceiptPage.end`): a receipt id, after the id of the
# transaction that admitted it on PostgreSQL.
_POSITION = re.compile(r"(?:\d{1,20}\.)?[0-9A-Za-z]{1,64}")


def _query(visit: Visit, allowed: tuple[str, ...]) -> dict[str, str]:
    """The page's query parameters; an unknown or repeated one is `400`, as in the API."""
    found: dict[str, str] = {}
    for name, value in visit.request.query.items():
        if name not in allowed or name in found:
            raise errors.InvalidRequest(
                f"parameter {name!r}: this page takes {', '.join(allowed) or 'none'}, once each"
            )
        found[name] = value
    return found


# -- overview ---------------------------------------------------------------------------------


async def overview(visit: Visit) -> web.Response:
    _query(visit, ())
    store = visit.app[appkeys.STORE]
    now = time.time()
    start = now - HOUR
    recent = await reads.receipts_since(store, start)
    slice_s = HOUR / BUCKETS
    labels = [
        f"{charts.time_label(start + i * slice_s, HOUR)}–"
        f"{charts.time_label(start + (i + 1) * slice_s, HOUR)}"
        for i in range(BUCKETS)
    ]

    def per_slice(receipts: list[Receipt]) -> charts.BarChart:
        counts = tallies.bucket_counts((r.created_at for r in receipts), start, now, BUCKETS)
        return charts.bar_chart(counts, labels, 240, 56)

    items = recent.items
    refused = [r for r in items if r.status == "rejected"]
    lost = [r for r in items if r.status in tallies.LOST_STATUSES]
    waiting, counted_all = await reads.count_waiting(store)
    held = await reads.leases(store, "held", None, reads.LEASE_PAGE)
    policies = visit.app[appkeys.POLICIES]
    external = [r.match for r in policies.rules if r.lease.issuer == "external"]
    epoch_change = await store.latest_epoch_change()  # docs/contract.md §19
    return visit.page(
        "overview.html",
        complete=recent.complete,
        calls=per_slice(items),
        refusals=per_slice(refused),
        lost=per_slice(lost),
        totals={"calls": len(items), "refusals": len(refused), "lost": len(lost)},
        codes=tallies.refusals_by_code(refused),
        waiting=waiting,
        waiting_complete=counted_all,
        oldest_s=await store.oldest_unknown_age() if waiting else 0.0,
        held=len(held),
        held_complete=len(held) < reads.LEASE_PAGE,
        axis=(charts.time_label(start, HOUR), charts.time_label(now, HOUR)),
        epoch_change=epoch_change if epoch_change and epoch_change.previous else None,
        now=now,
        on_hold=tallies.globs_on_hold(await store.fence_floors(), dict.fromkeys(external)),
    )


# -- the reconciliation queue -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Waiting:
    """A receipt in the queue, with what the page says about it."""

    receipt: Receipt
    age_s: float
    ready_in_s: float  # 0 once it may be resolved
    has_probe: bool


async def queue(visit: Visit) -> web.Response:
    query = _query(visit, ("after",))
    after = query.get("after")
    if after is not None and not _POSITION.fullmatch(after):
        raise errors.InvalidRequest(f"after {after!r}: a position in the queue")
    app = visit.app
    page = await reads.waiting(app[appkeys.STORE], after)
    waits = reconcile.wait_times(app)
    policies = app[appkeys.POLICIES]
    now = time.time()
    rows = []
    for receipt in page.items:
        ready_at = waits.ready_at(receipt.upstream, receipt.forwarded_at, receipt.created_at)
        rule = policies.rule_for(receipt.upstream, receipt.resource)
        rows.append(
            Waiting(
                receipt=receipt,
                age_s=now - receipt.created_at,
                ready_in_s=max(0.0, ready_at - now),
                has_probe=rule is not None and rule.probe is not None,
            )
        )
    count, counted_all = await reads.count_waiting(app[appkeys.STORE])
    return visit.page(
        "queue.html",
        rows=rows,
        count=count,
        count_complete=counted_all,
        after=after,
        next_after=page.end if len(page.items) == reads.QUEUE_PAGE else None,
        here=visit.request.path_qs,
    )


# -- leases -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeaseRow:
    lease: Lease
    left: str
    revocable: bool  # an admin may end it: held, or expired and still keeping its lock delay


async def leases(visit: Visit) -> web.Response:
    query = _query(visit, ("state", "after"))
    state, after = query.get("state"), query.get("after")
    if state is not None and state not in LEASE_STATES:
        raise errors.InvalidRequest(f"state {state!r}: one of {', '.join(LEASE_STATES)}")
    if after is not None and not grammar.valid_resource(after):
        raise errors.InvalidResource(f"after {after!r} is not a resource")
    items = await reads.leases(visit.app[appkeys.STORE], state, after)
    now = time.time()
    rows = [_lease_row(visit, lease, now) for lease in items]
    return visit.page(
        "leases.html",
        rows=rows,
        state=state,
        states=LEASE_STATES,
        next_after=items[-1].resource if len(items) == reads.LEASE_PAGE else None,
        here=visit.request.path_qs,
        now=now,
    )


def _lease_row(visit: Visit, lease: Lease, now: float) -> LeaseRow:
    return LeaseRow(
        lease=lease,
        left=tallies.time_left(lease.state, lease.expires_at, now),
        revocable=visit.viewer.may.revoke and lease.state != "released",
    )


# -- one resource -----------------------------------------------------------------------------


async def resource(visit: Visit) -> web.Response:
    query = _query(visit, ("window",))
    window, span = tallies.window(query.get("window"))
    key = headers.check_resource(visit.request.match_info["resource"])
    app = visit.app
    store = app[appkeys.STORE]
    now = time.time()
    start = now - span
    found = await reads.receipts_since(store, start, resource=key)
    lease = await store.get_lease(key)
    points = [
        charts.FencePoint(
            at=r.created_at,
            fence=r.fence,
            admitted=r.status != "rejected",
            label=f"fence {r.fence}: {r.status}"
            + (f" ({r.reject_code})" if r.reject_code else "")
            + f", {r.method} {r.path}, receipt {r.id}",
        )
        for r in found.items
    ]
    return visit.page(
        "resource.html",
        resource=key,
        window=window,
        windows=list(tallies.WINDOWS),
        complete=found.complete,
        chart=charts.fence_chart(points, *charts.fitted_span([p.at for p in points], start, now)),
        receipts=list(reversed(found.items[-RECEIPTS_SHOWN:])),
        shown=min(len(found.items), RECEIPTS_SHOWN),
        total=len(found.items),
        statuses=tallies.status_counts(found.items),
        codes=tallies.refusals_by_code(found.items),
        lease=_lease_row(visit, lease, now) if lease is not None else None,
        gateway_issued=app[appkeys.POLICIES].lease_rule(key) is not None,
        here=visit.request.path_qs,
        now=now,
    )


# -- files and the rest -----------------------------------------------------------------------

_STATIC_TYPES = {
    "console.css": "text/css",
    "console.js": "text/javascript",
    "favicon.svg": "image/svg+xml",
}
_STATIC_FILES = {name: (STATIC / name).read_bytes() for name in _STATIC_TYPES}


async def static(visit: Visit) -> web.Response:
    _query(visit, ())
    name = visit.request.match_info["name"]
    if name not in _STATIC_TYPES:
        raise errors.NotFound(f"the console has no file {name!r}")
    return web.Response(body=_STATIC_FILES[name], content_type=_STATIC_TYPES[name], charset="utf-8")


async def not_found(visit: Visit) -> web.Response:
    raise errors.NotFound(f"the console has no page {visit.request.path}")
