"""Fence floors: what a restore and an admin's raises add to a resource's own fences
(docs/contract.md §18).

A store restored from a backup has forgotten every fence issued or accepted after the backup
was taken. The restore therefore leaves three things behind, which every backend stores as
rows and hands to these functions on each admission and acquire:

* a store-wide **floor** for gateway-issued resources: the highest fence the backup knew plus
  a gap, below which every token is stale and above which every acquire issues;
* an **epoch**, the number of restores so far: an external issuer's resource is on hold after
  a restore until a raise made since then covers it, since only the external issuer knows
  how far its tokens went meanwhile;
* **raises**: `at_least` values set by an admin for one resource (kept on the resource's own
  row, with the epoch it was made in) or for a glob (kept as a rule that also covers
  resources first seen later).

Plain functions on plain values, like `gateway.core.fences`: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.core.fences import Bound, Issuer
from gateway.core.globs import glob_matches
from gateway.core.grammar import MAX_FENCE

DEFAULT_GAP = 1_000_000


@dataclass(frozen=True, slots=True)
class Raise:
    """`POST /_gateway/v1/fences/raise`: every resource `match` covers, known or not, has a
    highest accepted fence of at least `at_least`; made in restore epoch `epoch`."""

    match: str
    at_least: int
    epoch: int


@dataclass(frozen=True, slots=True)
class Floors:
    """The store-wide part: the floor of gateway-issued fences, the restore epoch, the glob
    raises. A store that was never restored and never raised has `Floors()`."""

    floor: int = 0
    epoch: int = 0
    raises: tuple[Raise, ...] = ()


@dataclass(frozen=True, slots=True)
class FenceRow:
    """One resource's own fences row as the decisions need it. `lifted`: the restore epoch of
    the latest raise of this very resource (0: never raised)."""

    issued: int = 0
    accepted: int = 0
    lifted: int = 0


def raised(floors: Floors, resource: str) -> int:
    """The highest `at_least` of the glob raises covering `resource` (0: none)."""
    if not floors.raises:  # nearly every store: no generator made twice per admission
        return 0
    return max((r.at_least for r in floors.raises if glob_matches(r.match, resource)), default=0)


def on_hold(floors: Floors, resource: str, issuer: Issuer, lifted: int) -> bool:
    """An external resource after a restore, not yet covered by a raise made since."""
    if issuer != "external" or floors.epoch == 0 or lifted >= floors.epoch:
        return False
    return not any(
        r.epoch >= floors.epoch and glob_matches(r.match, resource) for r in floors.raises
    )


def bound(floors: Floors, resource: str, issuer: Issuer, row: FenceRow) -> Bound:
    """What `fences.check` must hold a token of `resource` to beyond its own rows."""
    accepted = max(row.accepted, raised(floors, resource))
    below = max(accepted, floors.floor) if issuer == "gateway" else accepted
    return Bound(below=below, on_hold=on_hold(floors, resource, issuer, row.lifted))


def accepted(floors: Floors, resource: str, row: FenceRow) -> int:
    """The resource's highest accepted fence with the glob raises that cover it."""
    return max(row.accepted, raised(floors, resource))


class FencesExhausted(Exception):
    """The resource's highest fence is the largest there is: no acquire can ever issue one
    above it (a raise or an external token went to the end of the range)."""


def next_fence(floors: Floors, resource: str, row: FenceRow) -> int:
    """An acquire's fence (docs/contract.md §6): above every fence issued or accepted, raised
    or not, and at least the store-wide floor. Never a fence past the range, and never one
    given before: `FencesExhausted` instead."""
    fence = max(max(row.issued, accepted(floors, resource, row)) + 1, floors.floor)
    if fence > MAX_FENCE:
        raise FencesExhausted(resource)
    return fence


def raise_to(current: int, at_least: int) -> int:
    """A raise never lowers a fence."""
    return max(current, at_least)


def restore_floor(highest: int, gap: int) -> int:
    """The store-wide floor a restore sets: the highest fence the restored store knows plus
    the gap, within the fence range."""
    return min(highest + gap, MAX_FENCE)


def highest(values: Iterable[int | None]) -> int:
    """The highest of a store's fences (issued, accepted, the floor, raises); 0 for none."""
    return max((v for v in values if v is not None), default=0)


def covered(match: str, resources: Iterable[str]) -> list[str]:
    """The resources of `resources` a glob covers."""
    return [r for r in resources if glob_matches(match, r)]


def literal_prefix(match: str) -> str:
    """The part of a glob before its first `*`: every resource it covers starts with it, so a
    store can narrow its scan of known resources to an index range."""
    return match.split("*", 1)[0]
