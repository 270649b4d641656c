"""Fence floors on PostgreSQL (docs/contract.md §18): statements and steps run inside
`PostgresStore`'s transactions. The decisions are `gateway.core.floors'`.

Every step that decides about one resource reads the floors in the statement that locks the
resource's `fences` row (`FLOORS_RETURNING`; `admit_fresh`, schema version 9, in its own
statements after the lock), so they cost admission no round trip of their own.
A glob raise locks each known resource it covers; a restore locks the whole `fences` table, so
no admission on any replica straddles it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.core import floors
from gateway.core.floors import Floors
from gateway.store.base import RestoreReport
from gateway.store.floor_rows import RESTORED_ERROR, floors_of, raises_of, raises_of_json
from gateway.store.rows import count_by_upstream

_NOW = "extract(epoch from clock_timestamp())::float8"

FLOORS_RETURNING = (
    "lifted, (SELECT floor FROM fence_floor WHERE id = 1) AS floor, "
    "(SELECT epoch FROM fence_floor WHERE id = 1) AS epoch, "
    "(SELECT json_agg(json_build_array(match, at_least, epoch)) FROM fence_raises) AS raises"
)
"""What a statement that locks a resource's fences row also returns: the row's `lifted` and
the store-wide floors."""


def floors_of_locked(locked: Mapping[str, Any]) -> Floors:
    """The floors a `FLOORS_RETURNING` statement read."""
    return floors_of(locked["floor"], locked["epoch"], raises_of_json(locked["raises"]))


async def read_floors(conn: Any) -> Floors:
    row = await conn.fetchrow("SELECT floor, epoch FROM fence_floor WHERE id = 1")
    raises = raises_of(await conn.fetch("SELECT match, at_least, epoch FROM fence_raises"))
    return floors_of(row["floor"] if row else None, row["epoch"] if row else None, raises)


async def raise_one(conn: Any, resource: str, at_least: int, lock_fences: str) -> int:
    """`PUT /_gateway/v1/fences/{resource}` under the resource's lock (`lock_fences`: the
    store's statement that locks and reads the row with `FLOORS_RETURNING`)."""
    locked = await conn.fetchrow(lock_fences, resource)
    known = floors_of_locked(locked)
    row = floors.FenceRow(locked["issued"], locked["accepted"], locked["lifted"])
    highest = floors.raise_to(floors.accepted(known, resource, row), at_least)
    await conn.execute(
        "UPDATE fences SET accepted = $2, lifted = greatest(lifted, $3) WHERE resource = $1",
        resource,
        highest,
        known.epoch,
    )
    return highest


async def raise_glob(conn: Any, match: str, at_least: int) -> int:
    """`POST /_gateway/v1/fences/raise`: the rule, then every known resource it covers,
    locked in resource order (as the sweeper locks them) and raised."""
    epoch = await conn.fetchval("SELECT epoch FROM fence_floor WHERE id = 1 FOR SHARE")
    await conn.execute(
        "INSERT INTO fence_raises (match, at_least, epoch, raised_at) "
        f"VALUES ($1, $2, $3, {_NOW}) ON CONFLICT (match) DO UPDATE SET "
        "at_least = greatest(fence_raises.at_least, excluded.at_least), "
        "epoch = greatest(fence_raises.epoch, excluded.epoch), raised_at = excluded.raised_at",
        match,
        at_least,
        epoch,
    )
    candidates = [
        row["resource"]
        for row in await conn.fetch(
            "SELECT resource FROM fences WHERE starts_with(resource, $1) ORDER BY resource",
            floors.literal_prefix(match),
        )
    ]
    covered = floors.covered(match, candidates)
    if covered:
        await conn.execute(
            "WITH l AS (SELECT resource FROM fences WHERE resource = ANY($1) "
            "ORDER BY resource FOR UPDATE) "
            "UPDATE fences f SET accepted = greatest(f.accepted, $2), "
            "lifted = greatest(f.lifted, $3) FROM l WHERE f.resource = l.resource",
            covered,
            at_least,
            epoch,
        )
    return len(covered)


async def highest_fence(conn: Any) -> int:
    row = await conn.fetchrow("SELECT max(issued) AS i, max(accepted) AS a FROM fences")
    known = await read_floors(conn)
    return floors.highest([row["i"], row["a"], known.floor, *(r.at_least for r in known.raises)])


async def apply_restore(
    conn: Any, gap: int, beyond: int, error: str = RESTORED_ERROR
) -> RestoreReport:
    """`fence-gateway restore --floor-only` after `pg_restore`, and a new store epoch after
    an asynchronous failover (docs/contract.md §19, `error` then names it): one transaction
    that first shuts every admission, acquire and raise out (the table lock), so none of
    them, on any replica, decides on the fences from before it."""
    # The floor row first, then the table: a glob raise takes them in the same order.
    locked = await conn.fetchrow(
        f"SELECT floor, epoch, {_NOW} AS now FROM fence_floor WHERE id = 1 FOR UPDATE"
    )
    await conn.execute("LOCK TABLE fences IN EXCLUSIVE MODE")
    top = max(await highest_fence(conn), beyond)
    floor = floors.restore_floor(top, gap)
    epoch = int(locked["epoch"]) + 1
    now = locked["now"]
    await conn.execute(
        "UPDATE fence_floor SET floor = greatest(floor, $1), epoch = $2, restored_at = $3 "
        "WHERE id = 1",
        floor,
        epoch,
        now,
    )
    expired = await conn.fetch(
        "UPDATE leases SET expires_at = least(expires_at, $1) WHERE state = 'held' "
        "RETURNING resource",
        now,
    )
    unknown = await conn.fetch(
        "UPDATE receipts SET status = 'outcome_unknown', error = $1 WHERE status = 'pending' "
        "RETURNING upstream",
        error,
    )
    return RestoreReport(top, floor, epoch, len(expired), count_by_upstream(unknown))


async def known_resources(conn: Any) -> list[str]:
    return [row["resource"] for row in await conn.fetch("SELECT resource FROM fences ORDER BY 1")]
