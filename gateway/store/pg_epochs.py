"""Store epochs on PostgreSQL (docs/contract.md §19): what the server is, the `store_epochs`
table, and recording a new epoch once, whichever replica gets there first.

The decisions are `gateway.core.epochs'`. Recording runs in one transaction under an
advisory lock and judges again under it: replicas that reach a new epoch together take turns,
and the later ones find it recorded. Under `async` the previous epoch may have lost commits,
so recording a new one applies the §18 floor in the same transaction, exactly as
`fence-gateway restore --floor-only` does (`postgres_floors.apply_restore`).
"""

from __future__ import annotations

from typing import Any

from gateway.core import epochs
from gateway.core.epochs import Epoch, Known, Mode, StoreEpoch
from gateway.store import postgres_floors
from gateway.store.base import EpochChange

FAILOVER_ERROR = "store_failover"
"""The `error` of a receipt a new epoch found `pending` and turned `outcome_unknown`."""

_EPOCH_LOCK = 0x66656E6366  # pg_advisory_xact_lock key, beside the migrations' "fence"
_NOW = "extract(epoch from clock_timestamp())::float8"

# Where the server is now. The timeline is the live one, of the WAL insert position: the
# last checkpoint's (`pg_control_checkpoint()`) still names the old timeline for a while
# after a promotion.
SEE = (
    "SELECT (SELECT system_identifier FROM pg_control_system())::text AS system_id, "
    "pg_walfile_name(pg_current_wal_insert_lsn()) AS walfile, "
    "(pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint AS lsn"
)
_LATEST = "SELECT * FROM store_epochs ORDER BY id DESC LIMIT {n}"


def epoch_of(row: Any) -> Epoch:
    return Epoch(row["system_id"], epochs.timeline_of(row["walfile"]), int(row["lsn"]))


def _store_epoch(row: Any) -> StoreEpoch:
    return StoreEpoch(
        row["id"],
        row["system_id"],
        row["timeline"],
        row["mode"],
        row["floor"],
        row["recorded_at"],
    )


async def see(conn: Any) -> Epoch:
    return epoch_of(await conn.fetchrow(SEE))


async def latest(conn: Any) -> StoreEpoch | None:
    row = await conn.fetchrow(_LATEST.format(n=1))
    return _store_epoch(row) if row else None


async def latest_change(conn: Any) -> EpochChange | None:
    rows = await conn.fetch(_LATEST.format(n=2))
    if not rows:
        return None
    row = rows[0]
    previous = _store_epoch(rows[1]) if len(rows) > 1 else None
    return EpochChange(previous, _store_epoch(row), row["reason"], None)


async def record(
    conn: Any,
    remembered: tuple[int, int] | None,
    mode: Mode,
    gap: int,
    instance: str,
) -> tuple[StoreEpoch, EpochChange | None, Epoch]:
    """Inside a transaction: the epoch the server is in, recorded first when it is new (the
    change, None when it was not new, or another replica recorded it first), and where the
    server was seen.

    `remembered` must have been read before this call: the server is seen again under the
    lock, so a WAL position read on another connection meanwhile can never look like one
    gone back."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", _EPOCH_LOCK)
    seen = await see(conn)
    before = await latest(conn)
    verdict = epochs.judge(before, seen, remembered)
    if isinstance(verdict, Known):
        return verdict.epoch, None, seen
    report = None
    if verdict.floor:
        report = await postgres_floors.apply_restore(conn, gap, 0, error=FAILOVER_ERROR)
    floor = None if before is None else ("applied" if verdict.floor else "not_needed")
    row = await conn.fetchrow(
        "INSERT INTO store_epochs (system_id, timeline, wal_lsn, mode, floor, reason, "
        f"recorded_at, recorded_by) VALUES ($1, $2, $3, $4, $5, $6, {_NOW}, $7) RETURNING *",
        seen.system_id,
        seen.timeline,
        seen.lsn,
        mode,
        floor,
        verdict.reason,
        instance,
    )
    current = _store_epoch(row)
    return current, EpochChange(before, current, verdict.reason, report), seen


async def others_alive(conn: Any, instance: str, silent_after_s: float) -> int:
    """How many other instances of the store heartbeat, by the database's clock."""
    return int(
        await conn.fetchval(
            f"SELECT count(*) FROM instances WHERE id <> $1 AND heartbeat_at > {_NOW} - $2",
            instance,
            silent_after_s,
        )
    )


async def set_mode(conn: Any, epoch_id: int, mode: Mode) -> None:
    """The current epoch is served in `mode` from now on (no other instance is alive)."""
    await conn.execute("UPDATE store_epochs SET mode = $2 WHERE id = $1", epoch_id, mode)
