"""The store seam: the values that cross it, the `Store` protocol, and its one error.

A backend implements each method as one atomic transaction in its own SQL. The proxy and
the APIs see only this module, so a new backend never touches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

from gateway.errors import StoreUnavailable

__all__ = ["Admitted", "Call", "Outcome", "ReceiptQuery", "Refused", "Rejection", "Replayed",
           "Store", "StoreUnavailable", "rfc3339"]

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
