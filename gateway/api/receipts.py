"""The receipt API (SPEC 7): what reconcilers read, and how they resolve lost outcomes."""

from __future__ import annotations

from aiohttp import web

from gateway import errors, keys
from gateway.api import params
from gateway.store.base import ReceiptQuery

STATUSES = frozenset({"pending", "succeeded", "failed", "not_sent", "outcome_unknown",
                      "rejected", "reconciled"})
_FILTERS = ("resource", "status", "owner", "idempotency_key", "fence_min", "fence_max", "since",
            "until", "limit", "cursor")

routes = web.RouteTableDef()


@routes.get("/_gateway/v1/receipts")
async def list_receipts(request: web.Request) -> web.Response:
    query = params.only(request, _FILTERS)
    status = query.get("status")
    if status is not None and status not in STATUSES:
        raise errors.InvalidRequest(f"status {status!r}: one of {sorted(STATUSES)}")
    return await _page(request, ReceiptQuery(
        resource=query.get("resource"), status=status, owner=query.get("owner"),
        idempotency_key=query.get("idempotency_key"),
        fence_min=params.integer(query, "fence_min"), fence_max=params.integer(query,
                                                                               "fence_max"),
        since=params.moment(query, "since"), until=params.moment(query, "until"),
        after_id=params.decode_cursor(query), limit=params.limit(query)))


@routes.get("/_gateway/v1/reconciliation")
async def reconciliation(request: web.Request) -> web.Response:
    """The reconcilers' work queue: `outcome_unknown` receipts, oldest first."""
    query = params.only(request, ("limit", "cursor"))
    return await _page(request, ReceiptQuery(status="outcome_unknown",
                                             after_id=params.decode_cursor(query),
                                             limit=params.limit(query)))


@routes.get("/_gateway/v1/receipts/{id}")
async def get_receipt(request: web.Request) -> web.Response:
    params.only(request, ())
    receipt = await request.app[keys.STORE].get_receipt(request.match_info["id"])
    if receipt is None:
        raise errors.NotFound(f"no receipt {request.match_info['id']!r}")
    return web.json_response(receipt)


async def _page(request: web.Request, query: ReceiptQuery) -> web.Response:
    items = await request.app[keys.STORE].list_receipts(query)
    return web.json_response(params.page(items, query.limit, "id"))
