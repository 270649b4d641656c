"""The fence check (docs/contract.md §3, step 4): is this token the current owner's?

Plain functions on plain values: each store reads the resource's fences and lease inside its
admission transaction, asks these, and writes what they decide, so every backend decides alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Issuer = Literal["gateway", "external"]

FenceRefusal = Literal[
    "fence_not_issued", "stale_fence", "lease_expired", "not_lease_holder", "owner_mismatch"
]


@dataclass(frozen=True, slots=True)
class LeaseView:
    """A resource's lease record as the fence check needs it."""

    owner: str
    fence: int
    client: str | None
    live: bool  # held and not yet past expires_at by the store's clock


@dataclass(frozen=True, slots=True)
class Bound:
    """What a restore and an admin's raises add to a resource's own fences (docs/contract.md
    §18, worked out by `gateway.core.floors`): a token below `below` is stale, and a resource
    `on_hold` refuses every token. `NO_BOUND` adds nothing."""

    below: int = 0
    on_hold: bool = False


NO_BOUND = Bound()


def check_external(fence: int, accepted: int) -> FenceRefusal | None:
    """An external issuer's token is good when it is not below the highest accepted."""
    return "stale_fence" if fence < accepted else None


def check_gateway(
    fence: int,
    issued: int,
    lease: LeaseView | None,
    owner: str | None,
    client: str | None,
    clients_configured: bool,
) -> FenceRefusal | None:
    """The checks for a lease the gateway issued, in the contract's order."""
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
    if not lease.live:
        return "lease_expired"
    return None


def check(
    issuer: Issuer,
    fence: int,
    issued: int,
    accepted: int,
    lease: LeaseView | None,
    owner: str | None,
    client: str | None,
    clients_configured: bool,
    bound: Bound = NO_BOUND,
) -> tuple[FenceRefusal | None, str | None]:
    """Step 4 for either issuer: the refusal (None: go on), and the owner the receipt
    records. `lease` is only looked at for the gateway issuer. `bound` comes first: a token
    below a restore's floor or a raise is stale before it can be a forgery (§18)."""
    if bound.on_hold or fence < bound.below:
        return "stale_fence", recorded_owner(owner, fence, lease if issuer == "gateway" else None)
    if issuer == "external":
        return check_external(fence, accepted), owner
    refusal = check_gateway(fence, issued, lease, owner, client, clients_configured)
    return refusal, recorded_owner(owner, fence, lease)


def recorded_owner(presented: str | None, fence: int, lease: LeaseView | None) -> str | None:
    """The receipt's `owner`: the lease's owner when the token is its fence, else
    `X-Lease-Owner` as presented (docs/contract.md §7)."""
    if lease is not None and lease.fence == fence:
        return lease.owner
    return presented
