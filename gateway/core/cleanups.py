"""Sweeper cleanups (docs/contract.md §9): the next step for a rule's owed `on_expiry` call.

An owed cleanup is written in the transaction that marks a lease expired and forgotten only
once the call is known to have happened, or a new owner took the resource. Each attempt is
claimed with the acquire CAS (`gateway.core.leases.decide_acquire`) under a new fence, so with
several sweepers each attempt is made once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.core.idempotency import KeyState, sweep_key


@dataclass(frozen=True, slots=True)
class OwedCleanup:
    resource: str
    lease_fence: int  # the expired lease this cleanup follows
    lease_owner: str
    due_at: float
    attempts: int
    sweep_fence: int | None  # the sweeper's lease of its latest attempt
    last_error: str | None = None


ClaimState = Literal["claimed", "waiting", "done", "superseded", "busy", "not_due"]


@dataclass(frozen=True, slots=True)
class CleanupClaim:
    """What a claim decided.

    `claimed`: the sweeper now holds `fence`; make the call with `key`. `waiting`: an earlier
    attempt's outcome is pending or unknown (`receipt_id`). `done`: an earlier attempt turned
    out to have happened. `superseded`: a new owner took the resource; the cleanup is dropped.
    `busy`: the resource is still held (by `holder`). `not_due`: nothing to do yet.
    """

    state: ClaimState
    fence: int | None = None
    key: str | None = None
    attempt: int = 0
    lease_fence: int | None = None
    lease_owner: str | None = None
    receipt_id: str | None = None
    holder: str | None = None


def claimed(owed: OwedCleanup, fence: int) -> CleanupClaim:
    """The sweeper took the resource under `fence`: this attempt's claim."""
    return CleanupClaim(
        "claimed",
        fence=fence,
        key=sweep_key(fence),
        attempt=owed.attempts + 1,
        lease_fence=owed.lease_fence,
        lease_owner=owed.lease_owner,
    )


def row_action(claim: CleanupClaim) -> Literal["recheck", "forget", "keep"]:
    """What the owed row needs after a claim: looked at again later (it waits for an unknown
    outcome or a held resource), forgotten (done, or superseded), or kept as it is."""
    if claim.state in ("waiting", "busy"):
        return "recheck"
    if claim.state in ("done", "superseded"):
        return "forget"
    return "keep"


def decide_claim(
    owed: OwedCleanup,
    earlier: KeyState | None,
    current_fence: int | None,
    current_owner: str | None,
    now: float,
) -> CleanupClaim | None:
    """The claim's verdict before the acquire; None means "try to acquire" (the store then
    runs the acquire CAS and answers `claimed` or `busy`).

    `earlier`: the key state of the latest attempt (`gw-sweep-{sweep_fence}`), if any.
    `current_fence`/`current_owner`: the resource's lease record now.
    """
    if now < owed.due_at:
        return CleanupClaim("not_due")
    if owed.sweep_fence is not None and earlier is not None:
        if earlier.status in ("pending", "outcome_unknown"):
            return CleanupClaim("waiting", receipt_id=earlier.receipt_id)
        if earlier.status == "succeeded" or (
            earlier.status == "reconciled" and earlier.resolution != "not_applied"
        ):
            return CleanupClaim("done", receipt_id=earlier.receipt_id)
    # Still owed. The lease must be the one this cleanup follows (the expired owner's, or the
    # sweeper's last attempt); anything newer means a new owner took the resource.
    expected = owed.sweep_fence or owed.lease_fence
    if current_fence != expected:
        return CleanupClaim("superseded", holder=current_owner)
    return None
