"""The store seam: the values that cross it, the `Store` protocol, and its one error.

A backend implements each method as one atomic transaction in its own SQL. The proxy and
the APIs see only this module, so a new backend never touches them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

from gateway.core.errors import StoreUnavailable

__all__ = ["Admitted", "Call", "CleanupClaim", "CleanupDelay", "Outcome", "ReceiptQuery",
           "Refused", "Rejection", "Replayed", "Store", "StoreUnavailable", "rfc3339", "sweep_key"]

OutcomeStatus = Literal["succeeded", "failed", "not_sent", "outcome_unknown"]


@dataclass(frozen=True, slots=True)
class Call:
    """A fenced call that passed the header checks, as admission needs it."""

    resource: str
    fence: int
    owner: str | None          # X-Lease-Owner as presented
    client: str | None
    upstream: str
    method: str
    path: str                  # after the mount, with the query
    issuer: Literal["gateway", "external"]
    idempotency_key: str
    fingerprint: str
    retry_statuses: frozenset[int]
    retention_s: float
    clients_configured: bool = False


@dataclass(frozen=True, slots=True)
class Admitted:
    receipt_id: str
    attempt: int
    owner: str | None


@dataclass(frozen=True, slots=True)
class Replayed:
    receipt_id: str
    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass(frozen=True, slots=True)
class Refused:
    """Admission said no: `code` is a SPEC 5 code; `receipt_id` is the rejected receipt."""

    code: str
    receipt_id: str
    holder_receipt_id: str | None = None  # the receipt an idempotency refusal points at


@dataclass(frozen=True, slots=True)
class Rejection:
    """A call refused before admission (SPEC 3 steps 2 to 3c), to be kept as a receipt."""

    resource: str
    fence: int
    owner: str | None
    client: str | None
    upstream: str
    method: str
    path: str
    code: str
    http_status: int


@dataclass(frozen=True, slots=True)
class Outcome:
    status: OutcomeStatus
    http_status: int | None = None
    error: str | None = None
    forwarded_at: float | None = None
    response: tuple[list[tuple[str, str]], bytes] | None = None  # kept for replay


@dataclass(frozen=True, slots=True)
class ReceiptQuery:
    resource: str | None = None
    status: str | None = None
    owner: str | None = None
    idempotency_key: str | None = None
    fence_min: int | None = None
    fence_max: int | None = None
    since: float | None = None
    until: float | None = None
    after_id: str | None = None
    limit: int = 100
    extra: dict[str, Any] = field(default_factory=dict)


class Store(Protocol):
    """What the gateway needs from durable state. Every method may raise StoreUnavailable."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...

    async def admit(self, call: Call) -> Admitted | Replayed | Refused:
        """Fence check, fence CAS, key claim and the receipt: one durable transaction."""

    async def reject(self, rejection: Rejection) -> str:
        """Keep a `rejected` receipt for a call refused before admission; its id."""

    async def complete(self, receipt_id: str, outcome: Outcome) -> None:
        """Record the outcome durably (late outcomes too, SPEC 3)."""

    async def mark_forwarded(self, receipt_id: str) -> None:
        """A call that waited after admission leaves now (reconcile grace counts from here)."""

    async def mark_incomplete(self, receipt_id: str) -> None:
        """The answer's body broke after its outcome was recorded."""

    async def get_receipt(self, receipt_id: str) -> dict[str, Any] | None: ...
    async def list_receipts(self, query: ReceiptQuery) -> list[dict[str, Any]]: ...

    async def heartbeat(self) -> None:
        """Refresh this instance's heartbeat: also the write check of readiness."""

    recovered: dict[str, int]  # receipts turned outcome_unknown at open, by upstream

    async def expire_pending(self, wait_s: dict[str, float], default_wait_s: float,
                             silent_after_s: float,
                             in_flight: frozenset[str]) -> dict[str, int]:
        """Turn lost `pending` receipts `outcome_unknown`; how many, by upstream."""

    async def prune(self, receipt_retention_s: float) -> int:
        """Delete idempotency keys past retention and completed receipts past theirs."""

    async def resolve(self, receipt_id: str, outcome: str, source: str, note: str | None,
                      wait_s: dict[str, float], default_wait_s: float) -> dict[str, Any] | str:
        """Reconcile an `outcome_unknown` receipt past its grace: the receipt, or
        `not_found` / `not_reconcilable`."""

    async def oldest_unknown_age(self) -> float: ...

    # leases (SPEC 6): the acquire is a compare-and-swap; fences never go back
    async def acquire(self, resource: str, owner: str, ttl_s: float, lock_delay_s: float,
                      client: str | None, acquire_key: str | None,
                      ) -> tuple[str, dict[str, Any], float | None]: ...
    async def renew(self, resource: str, owner: str, fence: int, ttl_s: float,
                    client: str | None = None) -> dict[str, Any] | None: ...
    async def release(self, resource: str, owner: str | None, fence: int | None,
                      client: str | None = None) -> tuple[bool, float | None]: ...
    async def get_lease(self, resource: str) -> dict[str, Any] | None: ...
    async def list_leases(self, prefix: str | None, state: str | None, after: str | None,
                          limit: int) -> list[dict[str, Any]]: ...
    async def expire_leases(self, cleanup_delay: CleanupDelay | None = None,
                            ) -> list[dict[str, Any]]: ...

    # sweeper cleanups (SPEC 9): owed in the expiry's transaction, claimed with the CAS
    async def due_cleanups(self, limit: int) -> list[str]: ...
    async def list_cleanups(self) -> list[dict[str, Any]]: ...
    async def claim_cleanup(self, resource: str, owner: str, ttl_s: float, lock_delay_s: float,
                            recheck_s: float) -> CleanupClaim: ...
    async def finish_cleanup(self, resource: str, fence: int, done: bool,
                             retry_at: float | None = None, error: str | None = None) -> None: ...
    async def drop_cleanup(self, resource: str) -> None: ...


CleanupDelay = Callable[[str, str], "float | None"]
"""(resource, owner of the expired lease) -> the rule's lock delay when a cleanup is owed."""


def sweep_key(fence: int) -> str:
    """The idempotency key of the sweeper's cleanup call under its lease `fence` (SPEC 9)."""
    return f"gw-sweep-{fence}"


@dataclass(frozen=True, slots=True)
class CleanupClaim:
    """What `claim_cleanup` decided.

    state: `claimed` (the sweeper now holds `fence`: make the call with `key`), `waiting`
    (an earlier attempt's outcome is pending or unknown: `receipt_id`), `done` (an earlier
    attempt turned out to have happened), `superseded` (a new owner took the resource; the
    cleanup is dropped), `busy` (the resource is still held, by `holder`), `not_due`.
    """

    state: str
    fence: int | None = None
    key: str | None = None
    attempt: int = 0
    lease_fence: int | None = None
    lease_owner: str | None = None
    receipt_id: str | None = None
    holder: str | None = None


def rfc3339(ts: float | None) -> str | None:
    """Epoch seconds → `2026-08-29T05:07:00.000Z` (UTC, milliseconds)."""
    if ts is None:
        return None
    moment = datetime.fromtimestamp(ts, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def parse_rfc3339(text: str) -> float:
    """RFC 3339 → epoch seconds; ValueError for anything else (a naive time is refused)."""
    moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return moment.timestamp()
