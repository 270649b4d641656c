"""The checks a fenced call and a session's upgrade share (docs/contract.md §3, steps 1, 2
and 4, "Rejected receipts"), and how a refusal by admission is told to the caller.

Both the call handler (`gateway.proxy.handler`) and the session handler
(`gateway.proxy.sessions`) run these, so a resource, a signature or a refusal is judged one
way whatever the protocol.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from hashlib import sha256

from aiohttp import web
from multidict import CIMultiDictProxy

from gateway.config.policy import ResourceRule, Upstream
from gateway.core import errors
from gateway.observe import logs
from gateway.proxy import appkeys, headers
from gateway.proxy.flow import Flow
from gateway.store.base import Refused


def identify_caller(request: web.Request) -> None:
    """Step 1 for a proxied call: with a clients file, `Proxy-Authorization` names an `agent`
    or `admin` client (the `Authorization` header belongs to the tool)."""
    clients = request.app[appkeys.CLIENTS]
    if clients is None:
        return
    client = clients.identify(request.headers.getall("Proxy-Authorization", []))
    if not client.may("agent"):
        raise errors.Forbidden(f"client {client.name} may not make proxied calls")
    request[appkeys.CLIENT] = client


def rule_of(
    request: web.Request,
    flow: Flow,
    upstream: Upstream,
    presented: CIMultiDictProxy[str] | None = None,
    tool: str | None = None,
) -> ResourceRule:
    """Step 2: the resource, its rule and the client's scope, before the fence is looked at.
    `presented`: where the lease is, when not in the request's headers (an MCP tool call's
    `_meta`); `tool`: an MCP tool call's rule covers its tool too (docs/contract.md §16)."""
    flow.resource = resource = headers.parse_resource(
        request.headers if presented is None else presented
    )
    client = request.get(appkeys.CLIENT)
    flow.client = client.name if client is not None else None
    policies = request.app[appkeys.POLICIES]
    if tool is None:
        rule = policies.rule_for(upstream.name, resource)
    else:
        rule = policies.tool_rule(upstream.name, resource, tool)
    if rule is None:
        what = f"{resource!r}" if tool is None else f"{resource!r} and tool {tool!r}"
        raise errors.ResourceNotAllowed(
            f"no resource rule of upstream {upstream.name} matches {what}"
        )
    if client is not None and not client.covers(resource):
        raise errors.Forbidden(f"client {flow.client} may not act on {resource!r}")
    flow.rule = rule
    return rule


def check_signature(
    request: web.Request,
    rule: ResourceRule,
    flow: Flow,
    lease: CIMultiDictProxy[str] | None = None,
) -> None:
    """Step 4 for an external issuer with a secret: the fence's HMAC signature (in `lease`,
    when the lease is not in the request's headers)."""
    env = rule.lease.hmac_secret_env
    if rule.lease.issuer != "external" or not env:
        return
    presented = headers.parse_signature(request.headers if lease is None else lease) or ""
    secret = request.app[appkeys.POLICIES].hmac_secrets[env]
    expected = hmac.new(secret, f"{flow.resource}\n{flow.fence}".encode(), sha256).hexdigest()
    # surrogateescape: header bytes that are not UTF-8 compare unequal instead of failing
    if not hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), expected.encode()):
        raise errors.BadFenceSignature("X-Fence-Signature is missing or wrong")


async def keep_rejection(
    request: web.Request,
    flow: Flow,
    error: errors.GatewayError,
    lease: CIMultiDictProxy[str] | None = None,
) -> None:
    """Leave a `rejected` receipt once resource and fence are readable (from `lease`, when
    the lease is not in the request's headers); if the store is down the client still gets
    `error`."""
    if flow.resource is not None and flow.fence is None:
        with contextlib.suppress(errors.GatewayError):  # step 2 failed: the fence, if any
            flow.fence = headers.parse_fence(request.headers if lease is None else lease)
    rejection = flow.rejection(error.code, error.status)
    if rejection is None:
        return
    try:
        receipt_id = await request.app[appkeys.STORE].reject(rejection)
    except errors.StoreUnavailable as exc:
        logs.event("store_write_failed", logging.WARNING, error=str(exc))
        return
    error.headers[headers.RECEIPT_HEADER] = receipt_id


def error_for(refused: Refused) -> errors.GatewayError:
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
