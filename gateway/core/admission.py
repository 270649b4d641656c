"""The decisions of admission, as plain functions on plain values (SPEC sections 3 and 4).

No aiohttp, no SQL: each store backend reads the rows inside its own transaction, asks these
functions, and writes what they decide, so every backend decides alike.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

# Receipt states after which an idempotency key is settled one way or the other.
COMPLETED = frozenset({"succeeded", "failed"})


@dataclass(frozen=True, slots=True)
class LeaseState:
    """The lease record of a resource, as the fence check needs it."""

    owner: str
    fence: int
    client: str | None
    held: bool  # state is 'held' and not yet past expires_at by the store's clock


@dataclass(frozen=True, slots=True)
class KeyState:
    """The latest non-rejected receipt that holds an idempotency key."""

    receipt_id: str
    fingerprint: str
    status: str
    http_status: int | None
    replayable: bool
    resolution: str | None
    attempt: int


def check_external_fence(fence: int, accepted: int) -> str | None:
    """An external issuer's token is good when it is not below the highest accepted."""
    return "stale_fence" if fence < accepted else None


def check_gateway_fence(fence: int, issued: int, lease: LeaseState | None,
                        owner: str | None, client: str | None,
                        clients_configured: bool) -> str | None:
    """The SPEC 3 step 4 checks for a lease the gateway issued, in the SPEC's order."""
    if fence > issued:
        return "fence_not_issued"
    current = lease.fence if lease is not None else issued
    if fence < current:
        return "stale_fence"
    if lease is None or lease.fence != fence:
        return "lease_expired"  # the record of this fence was swept
    if clients_configured and client != lease.client:
        return "not_lease_holder"
    if owner is not None and owner != lease.owner:
        return "owner_mismatch"
    if not lease.held:
        return "lease_expired"
    return None


@dataclass(frozen=True, slots=True)
class NewAttempt:
    attempt: int


@dataclass(frozen=True, slots=True)
class Replay:
    receipt_id: str


@dataclass(frozen=True, slots=True)
class Refuse:
    code: str
    receipt_id: str | None


IdempotencyDecision = NewAttempt | Replay | Refuse


def decide_idempotency(latest: KeyState | None, fingerprint: str,
                       retry_statuses: frozenset[int]) -> IdempotencyDecision:
    """The SPEC section 4 table: what a call with a key whose latest receipt is `latest` gets."""
    if latest is None:
        return NewAttempt(1)
    if latest.fingerprint != fingerprint:
        return Refuse("idempotency_key_reused", None)
    again = NewAttempt(latest.attempt + 1)
    status = latest.status
    if status in COMPLETED:
        if status == "failed" and latest.http_status in retry_statuses:
            return again
        if latest.replayable:
            return Replay(latest.receipt_id)
        return Refuse("already_completed", latest.receipt_id)
    if status == "pending":
        return Refuse("idempotency_in_flight", latest.receipt_id)
    if status == "outcome_unknown":
        return Refuse("outcome_unknown", latest.receipt_id)
    if status == "reconciled":
        if latest.resolution == "not_applied":
            return again
        return Refuse("already_completed", latest.receipt_id)
    if status == "not_sent":
        return again
    raise ValueError(f"a key cannot be held by a {status!r} receipt")


def fingerprint(method: str, target: str, body: bytes) -> str:
    digest = hashlib.sha256(f"{method}\n{target}\n".encode() + body)
    return "sha256:" + digest.hexdigest()


def derived_key(resource: str, method: str, target: str, body: bytes) -> str:
    digest = hashlib.sha256(f"{resource}\n{method}\n{target}\n".encode() + body)
    return "gw-" + digest.hexdigest()[:32]


def random_key() -> str:
    return "gw-" + secrets.token_hex(16)
