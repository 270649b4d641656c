"""Leases (docs/contract.md §6): the acquire compare-and-swap, renewal and release, decided.

A store reads the resource's lease row inside its transaction, asks one of these functions,
and writes what it decides; times are the store's clock (`now`), never a caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.core.fences import LeaseView
from gateway.core.times import rfc3339

LeaseState = Literal["held", "expired", "released"]
LEASE_STATES: tuple[LeaseState, ...] = ("held", "expired", "released")

SWEEPER_OWNER_PREFIX = "gateway-sweeper:"
"""Owner names of the sweeper's own leases (docs/contract.md §9); no client may take them."""


def sweeper_owner(instance: str) -> str:
    return f"{SWEEPER_OWNER_PREFIX}{instance}"


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease. As stored, a `held` lease may be past its expiry; `shown` says what it is."""

    resource: str
    owner: str
    fence: int
    state: LeaseState
    client: str | None
    acquire_key: str | None
    acquired_at: float
    renewed_at: float
    expires_at: float

    def live(self, now: float) -> bool:
        return self.state == "held" and now < self.expires_at

    def view(self, now: float) -> LeaseView:
        """What the fence check needs of this lease at `now`."""
        return LeaseView(
            owner=self.owner, fence=self.fence, client=self.client, live=self.live(now)
        )

    def shown(self, now: float) -> LeaseState:
        """A `held` lease past its expiry is shown `expired`, before the sweeper marks it."""
        return "expired" if self.state == "held" and now >= self.expires_at else self.state

    def to_json(self) -> dict[str, object]:
        """The lease of docs/contract.md §6; stores hand out leases already `shown`."""
        return {
            "resource": self.resource,
            "owner": self.owner,
            "fence": self.fence,
            "state": self.state,
            "acquired_at": rfc3339(self.acquired_at),
            "renewed_at": rfc3339(self.renewed_at),
            "expires_at": rfc3339(self.expires_at),
        }


@dataclass(frozen=True, slots=True)
class Grant:
    """Take the resource with a new fence. `held_seconds`: how long the lease taken over had
    been held, when the sweeper had not marked it expired yet (for the held-time metric)."""

    held_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Retried:
    """The same client retried its acquire (same Idempotency-Key): answer the same lease."""


@dataclass(frozen=True, slots=True)
class Held:
    """Someone holds it (even the same owner name): `lease_held`."""


AcquireDecision = Grant | Retried | Held


def decide_acquire(
    current: Lease | None,
    owner: str,
    client: str | None,
    acquire_key: str | None,
    lock_delay_s: float,
    now: float,
) -> AcquireDecision:
    """The acquire CAS: free when there is no lease, it was released, or it expired at least
    `lock_delay_s` ago."""
    if current is None:
        return Grant()
    live = current.live(now)
    # A retry answers with the lease it made only while that lease lives: handing back an
    # expired or released lease would give the client a dead fence.
    if (
        live
        and acquire_key is not None
        and current.acquire_key == acquire_key
        and current.client == client
        and current.owner == owner
    ):
        return Retried()
    if current.state != "released" and now < current.expires_at + lock_delay_s:
        return Held()
    if current.state == "held":  # taken over before the sweeper marked it expired
        return Grant(held_seconds=current.expires_at - current.acquired_at)
    return Grant()


def may_renew(
    current: Lease | None, owner: str, fence: int, client: str | None, now: float
) -> bool:
    """Only the live lease's own holder (owner, fence and acquiring client) renews it."""
    return (
        current is not None
        and current.owner == owner
        and current.fence == fence
        and current.client == client
        and current.live(now)
    )


@dataclass(frozen=True, slots=True)
class Release:
    """What a release (or, with no owner, an admin's revoke) does.

    ok: the caller gets 204 (else `lease_lost`). action: `release` marks the lease released
    now (`held_seconds` for the metric); `free` turns an expired lease released so the next
    acquire waits for no lock delay; `nothing` leaves the record as it is.
    """

    ok: bool
    action: Literal["release", "free", "nothing"] = "nothing"
    held_seconds: float | None = None


def decide_release(
    current: Lease | None, owner: str | None, fence: int | None, client: str | None, now: float
) -> Release:
    """Releasing a lease its holder already released, or that expired untaken, is fine. A
    release after expiry leaves the lease to the sweeper, which marks it expired and owes
    its `on_expiry` cleanup as for any expiry. `owner` None: an admin's revoke."""
    revoke = owner is None
    if current is None:
        return Release(ok=revoke)
    if not revoke and (
        current.owner != owner or current.fence != fence or current.client != client
    ):
        return Release(ok=False)
    if current.state != "held":
        return Release(
            ok=True, action="free" if revoke and current.state == "expired" else "nothing"
        )
    if not revoke and now >= current.expires_at:
        return Release(ok=True)  # expired untaken: the sweeper's to mark and clean up after
    return Release(
        ok=True, action="release", held_seconds=min(now, current.expires_at) - current.acquired_at
    )
