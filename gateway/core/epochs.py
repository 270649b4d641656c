"""Store epochs and synchronous replication (docs/contract.md §19): what a failover of the
database's primary means for the fences.

A store's epoch is its server's system identifier and *live* timeline (the timeline of the
current WAL insert position; the last checkpoint's lags a promotion). The store keeps a list
of the epochs it has served in, each with the replication mode it was served in. A server
whose epoch is not the latest one listed is a new epoch: a failover or switchover, a
promotion, a point-in-time restore, a dump restored into another cluster. So is a server whose
WAL position went back within the epoch (a disk snapshot restored in place).

What a new epoch does depends on what the previous one could have lost: served in `async`, a
promoted standby may lack the newest accepted fences, so the §18 floor is applied to the
whole store. Served in `sync`, only a synchronous standby is promoted and nothing is lost; but
a new system identifier or a WAL position gone back is a restore, not a promotion, and a
restore has forgotten whatever came after it whatever the mode: the floor again.

Plain functions on plain values: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["async", "sync"]
Floor = Literal["applied", "not_needed"]

DURABLE_COMMITS = ("on", "remote_write", "remote_apply")
"""`synchronous_commit` settings under which a commit waits for the synchronous standbys."""


@dataclass(frozen=True, slots=True)
class Epoch:
    """Where a server is: its identity, live timeline and WAL insert position (bytes)."""

    system_id: str
    timeline: int
    lsn: int

    def same_server_line(self, other: Epoch | StoreEpoch) -> bool:
        return self.system_id == other.system_id and self.timeline == other.timeline

    def __str__(self) -> str:
        return f"{self.system_id}/{self.timeline}"


@dataclass(frozen=True, slots=True)
class StoreEpoch:
    """One row of the store's epoch list."""

    id: int
    system_id: str
    timeline: int
    mode: Mode
    floor: Floor | None  # None: the store's very first epoch
    recorded_at: float

    def __str__(self) -> str:
        return f"{self.system_id}/{self.timeline}"


def timeline_of(walfile: str) -> int:
    """The timeline of a WAL file name (`pg_walfile_name`): its first eight hex digits."""
    if len(walfile) != 24:
        raise ValueError(f"{walfile!r} is not a WAL file name")
    return int(walfile[:8], 16)


@dataclass(frozen=True, slots=True)
class Known:
    """The server is in the latest recorded epoch: nothing to do."""

    epoch: StoreEpoch


@dataclass(frozen=True, slots=True)
class New:
    """A new epoch, to record; `floor`: whether recording it applies the §18 floor."""

    floor: bool
    reason: str


def judge(
    latest: StoreEpoch | None, seen: Epoch, remembered: tuple[int, int] | None
) -> Known | New:
    """What a server seen at `seen` is, given the latest recorded epoch and, when this replica
    has read from the latest epoch before, (that epoch's id, the highest WAL position read).

    A store with no epoch yet: its first, recorded without a floor."""
    if latest is None:
        return New(floor=False, reason="first epoch")
    if remembered is not None and remembered[0] > latest.id:
        # the epoch this replica read from is gone from the list: the store went back
        return New(floor=True, reason="the store's epochs went back (restored in place)")
    if not seen.same_server_line(latest):
        if seen.system_id != latest.system_id:
            return New(floor=True, reason="another cluster (a new system identifier)")
        return New(floor=latest.mode == "async", reason="a new timeline (a promotion)")
    if remembered is not None and remembered[0] == latest.id and seen.lsn < remembered[1]:
        return New(floor=True, reason="the WAL position went back (restored in place)")
    return Known(latest)


def replication_problem(standby_names: str, synchronous_commit: str) -> str | None:
    """Why commits on a server with these settings would not wait for a synchronous standby
    (None: they do)."""
    if not standby_names.strip():
        return "synchronous_standby_names is empty: no synchronous standby is configured"
    if synchronous_commit not in DURABLE_COMMITS:
        return (
            f"synchronous_commit is {synchronous_commit!r}: commits do not wait for the "
            "synchronous standby (use on, remote_write or remote_apply)"
        )
    return None


def is_replication_warning(severity: str, message: str, detail: str | None) -> bool:
    """A notice PostgreSQL sends on a commit that succeeded locally while its wait for
    synchronous replication was cancelled."""
    text = f"{message} {detail or ''}".lower()
    return severity.upper() == "WARNING" and (
        "synchronous replication" in text or "might not have been replicated" in text
    )
