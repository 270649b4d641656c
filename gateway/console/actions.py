"""The console's three changes: resolve a receipt, probe the tool for it, revoke a lease.

Each calls the very code the API calls (`gateway.api.receipts.resolve_receipt`,
`gateway.upkeep.reconcile.probe`, `gateway.api.leases.revoke`), so the checks, the receipt's
`resolution`, the metrics and the log lines are the same whichever way a person acts; the
console adds one `console_action` line saying who acted. A refusal of the change itself (not
reconcilable yet, a bad note) goes back to the page it came from as a message, since the person
is still there to read it.
"""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.api import leases as lease_api
from gateway.api import receipts as receipt_api
from gateway.console import paths, render
from gateway.console.guard import Visit
from gateway.core import errors
from gateway.observe import logs
from gateway.upkeep import reconcile


def _client(visit: Visit) -> str | None:
    """The client's name as the API would record it: None when the gateway runs open."""
    return None if visit.viewer.open_mode else visit.viewer.name


def _back(visit: Visit, default: str) -> str:
    """Where the form sends the browser back: read, and a bad field refused (`400`), before
    anything is changed."""
    return paths.back_to(visit.field("back", required=False), default)


def _refused(visit: Visit, error: errors.GatewayError, back: str) -> web.Response:
    if error.status >= 500:
        raise error
    visit.flash("refused", f"{error.title}: {error.detail}")
    return render.redirect(back)


async def resolve(visit: Visit) -> web.Response:
    outcome = visit.field("outcome")
    source = visit.field("source")
    note = visit.field("note", required=False) or None  # an empty box is no note
    back = _back(visit, paths.QUEUE)
    assert outcome is not None and source is not None  # required fields
    try:
        receipt_id = receipt_api.receipt_id_of(visit.request)
        receipt = await receipt_api.resolve_receipt(visit.app, receipt_id, outcome, source, note)
    except errors.GatewayError as error:
        return _refused(visit, error, back)
    logs.event(
        "console_action",
        logging.INFO,
        action="resolve",
        client=_client(visit),
        receipt_id=receipt.id,
        resource=receipt.resource,
        outcome=outcome,
        source=source,
    )
    visit.flash("done", f"receipt {receipt.id} on {receipt.resource} resolved {outcome}")
    return render.redirect(back)


async def probe(visit: Visit) -> web.Response:
    back = _back(visit, paths.QUEUE)
    try:
        receipt_id = receipt_api.receipt_id_of(visit.request)
        answer = await reconcile.probe(visit.app, receipt_id)
    except errors.GatewayError as error:
        return _refused(visit, error, back)
    asked = answer.get("probe")
    logs.event(
        "console_action",
        logging.INFO,
        action="probe",
        client=_client(visit),
        receipt_id=receipt_id,
        status=answer["status"],
    )
    if asked is None:
        outcome = (answer.get("resolution") or {}).get("outcome")
        visit.flash("done", f"the tool answered the probe: receipt {receipt_id} is {outcome}")
    else:
        said = asked.get("error") or f"answered {asked.get('status')}"
        visit.flash(
            "refused",
            f"the probe for {receipt_id} {said}: the outcome is still unknown, decide it from "
            "the tool's own records",
        )
    return render.redirect(back)


async def revoke(visit: Visit) -> web.Response:
    resource = visit.field("resource")
    back = _back(visit, paths.LEASES)
    assert resource is not None
    try:
        await lease_api.revoke(visit.app, resource, _client(visit))
    except errors.GatewayError as error:
        return _refused(visit, error, back)
    logs.event("console_action", action="revoke", client=_client(visit), resource=resource)
    visit.flash("done", f"the lease on {resource} is revoked: the next acquire gets a new fence")
    return render.redirect(back)
