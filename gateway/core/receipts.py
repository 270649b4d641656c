"""Receipts: the statuses a receipt moves through, and when a lost outcome may be reconciled.

    pending ──► succeeded | failed | not_sent          (the outcome was recorded)
        └─────► outcome_unknown ──► reconciled         (a reconciler decided)
    rejected                                           (refused; never forwarded)

See docs/contract.md §7 for the receipt's fields and §9 for how `pending` becomes unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from gateway.core import liveness

ReceiptStatus = Literal[
    "pending", "succeeded", "failed", "not_sent", "outcome_unknown", "rejected", "reconciled"
]
RECEIPT_STATUSES: tuple[ReceiptStatus, ...] = get_args(ReceiptStatus)

# Statuses whose receipts retention may delete: nothing is left to learn or decide about them.
SETTLED: frozenset[ReceiptStatus] = frozenset(
    {"succeeded", "failed", "not_sent", "rejected", "reconciled"}
)

Resolution = Literal["applied", "not_applied", "compensated"]
RESOLUTIONS: tuple[Resolution, ...] = get_args(Resolution)

Kind = Literal["call", "session"]


@dataclass(frozen=True, slots=True)
class ReconcileWaits:
    """How long after `forwarded_at` a call may still be running at its tool: its upstream's
    `timeout_s` + `GATEWAY_RECONCILE_GRACE_S`. `default` is for receipts of an upstream that
    is no longer in the policies."""

    per_upstream: dict[str, float]
    default: float
    # How long an admitted call may wait for older ones before it leaves (the longest
    # `queue_timeout_s` of the upstream's rules): a peer sharing the store cannot see that a
    # call waits, so its age rule allows for this as well (docs/contract.md §14).
    queued: dict[str, float] = field(default_factory=dict)

    def of(self, upstream: str) -> float:
        return self.per_upstream.get(upstream, self.default)

    def queue_of(self, upstream: str) -> float:
        return self.queued.get(upstream, max(self.queued.values(), default=0.0))

    def ready_at(self, upstream: str, forwarded_at: float | None, created_at: float) -> float:
        """When a receipt's call can no longer be running upstream."""
        return (forwarded_at if forwarded_at is not None else created_at) + self.of(upstream)


def may_resolve(status: ReceiptStatus, ready_at: float, now: float) -> bool:
    """Only an `outcome_unknown` receipt past its grace is reconciled (docs/contract.md §7)."""
    return status == "outcome_unknown" and now >= ready_at


def is_lost(
    *,
    in_flight_here: bool,
    heartbeat_at: float | None,
    silent_after_s: float,
    ready_at: float,
    now: float,
    session: bool = False,
) -> bool:
    """Whether a `pending` receipt's outcome is lost (docs/contract.md §9): its instance fell
    silent, or its call is older than its upstream's timeout plus grace. A receipt this
    process still has in flight is never lost, whatever its age; nor is an open session's
    while its instance's heartbeat is alive (§15: a session may stay open for hours)."""
    if in_flight_here:
        return False
    return liveness.silent(heartbeat_at, now, silent_after_s) or (not session and ready_at < now)
