"""The receipt API (docs/contract.md §7): what reconcilers read, and how they resolve lost outcomes.

Reading is plain store queries. Resolving and probing are in `gateway.probe`; this module
only checks the request and shapes the answer.
"""

from __future__ import annotations

import re

from aiohttp import web

from gateway.api import params
from gateway.core import errors
from gateway.core.receipts import RECEIPT_STATUSES, RESOLUTIONS, Resolution
from gateway.proxy import appkeys
from gateway.store.base import Receipt, ReceiptQuery
from gateway.upkeep import reconcile

_RESOLVE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "outcome": str,
    "source": str,
    "note": (str, type(None)),
}
MAX_SOURCE = 200
MAX_NOTE = 4096
# The checks on `source` and `note` are regular expressions so that the OpenAPI document can
# state them exactly (`gateway.api.openapi`): what it calls valid, the gateway accepts. Control
# characters would corrupt a log line or a terminal, and NUL cannot be PostgreSQL text.
_ANY_SOURCE_CHAR = r"[^\x00-\x1f\x7f-\x9f]"
_VISIBLE_SOURCE_CHAR = r"[^\x00-\x20\x7f-\x9f]"
SOURCE_PATTERN = f"^{_ANY_SOURCE_CHAR}*{_VISIBLE_SOURCE_CHAR}{_ANY_SOURCE_CHAR}*$"
NOTE_PATTERN = r"^[^\x00]*$"
_SOURCE = re.compile(SOURCE_PATTERN)
_NOTE = re.compile(NOTE_PATTERN)
# JSON's \u escapes can also carry half of a surrogate pair, which is no character at all and
# cannot be stored as UTF-8; no pattern needs to say so, no JSON Schema string holds one.
_UNPAIRED_SURROGATE = re.compile("[\ud800-\udfff]")


def _text_ok(value: str, pattern: re.Pattern[str], most: int) -> bool:
    return (
        len(value) <= most
        and pattern.fullmatch(value) is not None
        and _UNPAIRED_SURROGATE.search(value) is None
    )


_FILTERS = (
    "resource",
    "status",
    "owner",
    "idempotency_key",
    "fence_min",
    "fence_max",
    "since",
    "until",
    "limit",
    "cursor",
)

routes = web.RouteTableDef()


@routes.get("/_gateway/v1/receipts")
async def list_receipts(request: web.Request) -> web.Response:
    query = params.only(request, _FILTERS)
    status = query.get("status")
    if status is not None and status not in RECEIPT_STATUSES:
        raise errors.InvalidRequest(f"status {status!r}: one of {sorted(RECEIPT_STATUSES)}")
    return await _page(
        request,
        ReceiptQuery(
            resource=query.get("resource"),
            status=status,
            owner=query.get("owner"),
            idempotency_key=query.get("idempotency_key"),
            fence_min=params.integer(query, "fence_min"),
            fence_max=params.integer(query, "fence_max"),
            since=params.moment(query, "since"),
            until=params.moment(query, "until"),
            after=params.decode_cursor(query),
            limit=params.limit(query),
        ),
    )


@routes.get("/_gateway/v1/reconciliation")
async def reconciliation(request: web.Request) -> web.Response:
    """The reconcilers' work queue: `outcome_unknown` receipts, oldest first."""
    query = params.only(request, ("limit", "cursor"))
    return await _page(
        request,
        ReceiptQuery(
            status="outcome_unknown",
            after=params.decode_cursor(query),
            limit=params.limit(query),
        ),
    )


def receipt_id_of(request: web.Request) -> str:
    """The id in the path; no receipt id holds a NUL (which PostgreSQL text cannot)."""
    receipt_id = request.match_info["id"]
    if "\x00" in receipt_id:
        raise errors.NotFound(f"no receipt {receipt_id!r}")
    return receipt_id


@routes.get("/_gateway/v1/receipts/{id}")
async def get_receipt(request: web.Request) -> web.Response:
    params.only(request, ())
    receipt_id = receipt_id_of(request)
    receipt = await request.app[appkeys.STORE].get_receipt(receipt_id)
    if receipt is None:
        raise errors.NotFound(f"no receipt {receipt_id!r}")
    return web.json_response(receipt.to_json())


async def _page(request: web.Request, query: ReceiptQuery) -> web.Response:
    page = await request.app[appkeys.STORE].list_receipts(query)
    return web.json_response(
        params.page([receipt.to_json() for receipt in page.items], query.limit, page.end)
    )


@routes.post("/_gateway/v1/receipts/{id}/resolve")
async def resolve(request: web.Request) -> web.Response:
    """A person or a reconciler service says what became of an `outcome_unknown` call."""
    params.only(request, ())
    receipt_id = receipt_id_of(request)
    body = await params.json_body(request, _RESOLVE_FIELDS, ("outcome", "source"))
    receipt = await resolve_receipt(
        request.app, receipt_id, body["outcome"], body["source"], body.get("note")
    )
    return web.json_response(receipt.to_json())


async def resolve_receipt(
    app: web.Application, receipt_id: str, outcome: str, source: str, note: str | None
) -> Receipt:
    """Check a resolution and apply it: the API's resolve and the console's form both come
    here, so a decision is checked, logged and written on the receipt alike."""
    return await reconcile.resolve(app, receipt_id, *checked_resolution(outcome, source, note))


def checked_resolution(
    outcome: str, source: str, note: str | None
) -> tuple[Resolution, str, str | None]:
    """The resolution as given, or `400 invalid_request` saying what is wrong with it."""
    if outcome not in RESOLUTIONS:
        raise errors.InvalidRequest(f"outcome {outcome!r}: one of {list(RESOLUTIONS)}")
    if not _text_ok(source, _SOURCE, MAX_SOURCE):
        raise errors.InvalidRequest(
            f"source {source!r}: who decided, 1 to {MAX_SOURCE} printable characters (no control "
            "characters, not only spaces), e.g. operator:alice or service:billing-reconciler"
        )
    if note is not None and not _text_ok(note, _NOTE, MAX_NOTE):
        raise errors.InvalidRequest(
            f"note: at most {MAX_NOTE} characters, no NUL or unpaired surrogate"
        )
    return outcome, source, note  # `in RESOLUTIONS` narrowed outcome to a Resolution


@routes.post("/_gateway/v1/receipts/{id}/probe")
async def probe_receipt(request: web.Request) -> web.Response:
    """Run the policy's probe: the tool's own record resolves the receipt when it is clear."""
    params.only(request, ())
    receipt_id = receipt_id_of(request)
    await params.json_body(request, {}, ())  # no body, or an empty JSON object
    return web.json_response(await reconcile.probe(request.app, receipt_id))
