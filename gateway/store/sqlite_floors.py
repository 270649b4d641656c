"""Fence floors on SQLite (docs/contract.md §18): the statements, as functions of a connection
inside the caller's transaction.

`SqliteStore` runs them in its writer; `fence-gateway restore` runs `apply_restore` on the
copy of the backup it prepares before installing it, and `highest_fence` on the database it
replaces. The decisions are `gateway.core.floors`'.
"""

from __future__ import annotations

import sqlite3

from gateway.core import floors
from gateway.core.floors import FenceRow, Floors
from gateway.store.base import RestoreReport
from gateway.store.floor_rows import (
    RESTORED_ERROR,
    fence_row_of,
    floors_of,
    raises_of,
)
from gateway.store.rows import count_by_upstream


def read_floors(conn: sqlite3.Connection) -> Floors:
    row = conn.execute("SELECT floor, epoch FROM fence_floor WHERE id = 1").fetchone()
    raises = raises_of(conn.execute("SELECT match, at_least, epoch FROM fence_raises"))
    return floors_of(row["floor"] if row else None, row["epoch"] if row else None, raises)


def fence_row(conn: sqlite3.Connection, resource: str) -> FenceRow:
    return fence_row_of(
        conn.execute(
            "SELECT issued, accepted, lifted FROM fences WHERE resource = ?", (resource,)
        ).fetchone()
    )


def raise_one(conn: sqlite3.Connection, resource: str, at_least: int) -> int:
    """`PUT /_gateway/v1/fences/{resource}`: the resource's highest accepted fence now."""
    known = read_floors(conn)
    highest = floors.raise_to(floors.accepted(known, resource, fence_row(conn, resource)), at_least)
    conn.execute(
        "INSERT INTO fences (resource, accepted, lifted) VALUES (?, ?, ?) "
        "ON CONFLICT (resource) DO UPDATE SET accepted = excluded.accepted, "
        "lifted = max(lifted, excluded.lifted)",
        (resource, highest, known.epoch),
    )
    return highest


def raise_glob(conn: sqlite3.Connection, match: str, at_least: int, now: float) -> int:
    """`POST /_gateway/v1/fences/raise`: the rule for resources first seen later, and every
    known resource it covers raised now; how many those were."""
    epoch = read_floors(conn).epoch
    conn.execute(
        "INSERT INTO fence_raises (match, at_least, epoch, raised_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (match) DO UPDATE SET at_least = max(at_least, excluded.at_least), "
        "epoch = max(epoch, excluded.epoch), raised_at = excluded.raised_at",
        (match, at_least, epoch, now),
    )
    prefix = floors.literal_prefix(match)
    candidates = [
        row["resource"]
        for row in conn.execute(
            "SELECT resource FROM fences WHERE substr(resource, 1, ?) = ?", (len(prefix), prefix)
        )
    ]
    covered = floors.covered(match, candidates)
    conn.executemany(
        "UPDATE fences SET accepted = max(accepted, ?), lifted = max(lifted, ?) WHERE resource = ?",
        [(at_least, epoch, resource) for resource in covered],
    )
    return len(covered)


def highest_fence(conn: sqlite3.Connection) -> int:
    """The highest fence a store knows: issued, accepted, its floor, its raises. A database
    of a schema before floors has only the fences table."""
    row = conn.execute("SELECT max(issued) AS i, max(accepted) AS a FROM fences").fetchone()
    values = [row["i"], row["a"]]
    has_floors = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'fence_floor'"
    ).fetchone()
    if has_floors:
        known = read_floors(conn)
        values += [known.floor, *(r.at_least for r in known.raises)]
    return floors.highest(values)


def apply_restore(conn: sqlite3.Connection, gap: int, beyond: int, now: float) -> RestoreReport:
    """The floor, the new epoch, the held leases expired (the sweeper marks them and runs
    their `on_expiry` cleanups as for any expiry), the `pending` receipts `outcome_unknown`."""
    top = max(highest_fence(conn), beyond)
    floor = floors.restore_floor(top, gap)
    epoch = read_floors(conn).epoch + 1
    conn.execute(
        "UPDATE fence_floor SET floor = max(floor, ?), epoch = ?, restored_at = ? WHERE id = 1",
        (floor, epoch, now),
    )
    expired = conn.execute(
        "UPDATE leases SET expires_at = min(expires_at, ?) WHERE state = 'held' RETURNING resource",
        (now,),
    ).fetchall()
    unknown = conn.execute(
        "UPDATE receipts SET status = 'outcome_unknown', error = ? WHERE status = 'pending' "
        "RETURNING upstream",
        (RESTORED_ERROR,),
    ).fetchall()
    return RestoreReport(top, floor, epoch, len(expired), count_by_upstream(unknown))


def known_resources(conn: sqlite3.Connection) -> list[str]:
    return [
        row["resource"] for row in conn.execute("SELECT resource FROM fences ORDER BY resource")
    ]
