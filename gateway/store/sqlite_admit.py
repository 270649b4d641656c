"""What an admission on SQLite reads (docs/contract.md §3 steps 4 and 5, §18), in one
statement: the resource's fences row, the store-wide fence floor and glob raises, its lease,
the idempotency key's latest receipt and, without one, how many attempts earlier receipts of
the key made (its record was pruned).

One statement instead of five, each its own trip through the sqlite3 module and SQLite's
virtual machine, in the writer thread that every admission waits on. The reads are exact (the
same transaction as the writes that follow them); nothing is cached.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from gateway.core.floors import FenceRow, Floors
from gateway.core.idempotency import KeyState
from gateway.core.leases import Lease
from gateway.store.floor_rows import floors_of, raises_of_json
from gateway.store.rows import KEY_STATE_COLUMNS, LEASE_COLUMNS, key_state, lease_of, prefixed

_READ = (
    "SELECT f.issued, f.accepted, f.lifted, ff.floor, ff.epoch, "
    # NULL, not '[]', when there is no raise (nearly always): nothing to parse
    "(SELECT CASE WHEN count(*) THEN json_group_array(json_array(match, at_least, epoch)) END "
    "FROM fence_raises) AS raises, "
    + ", ".join(
        [f"l.{c} AS l_{c}" for c in LEASE_COLUMNS] + [f"r.{c} AS k_{c}" for c in KEY_STATE_COLUMNS]
    )
    + ", CASE WHEN r.id IS NULL AND ?2 IS NOT NULL THEN (SELECT count(*) FROM receipts p "
    "WHERE p.idempotency_key = ?2 AND p.resource = ?1 AND p.status != 'rejected') END AS pruned "
    "FROM (SELECT 1) one "
    "LEFT JOIN fences f ON f.resource = ?1 "
    "LEFT JOIN fence_floor ff ON ff.id = 1 "
    "LEFT JOIN leases l ON l.resource = ?1 "
    "LEFT JOIN idempotency_keys k ON k.resource = ?1 AND k.key = ?2 "
    "LEFT JOIN receipts r ON r.id = k.receipt_id"
)


@dataclass(frozen=True, slots=True)
class AdmitRead:
    row: FenceRow
    floors: Floors
    lease: Lease | None
    latest: KeyState | None  # the key's latest receipt
    pruned: int  # without one: the attempts of the key's earlier receipts still kept


def read(conn: sqlite3.Connection, resource: str, key: str | None) -> AdmitRead:
    """Everything admission decides on, for `resource` and `key` (None: a session's)."""
    got = conn.execute(_READ, (resource, key)).fetchone()
    fence_row = (
        FenceRow()
        if got["issued"] is None
        else FenceRow(got["issued"], got["accepted"], got["lifted"])
    )
    return AdmitRead(
        fence_row,
        floors_of(got["floor"], got["epoch"], raises_of_json(got["raises"])),
        lease_of(prefixed(got, "l_")) if got["l_resource"] is not None else None,
        key_state(prefixed(got, "k_")) if got["k_id"] is not None else None,
        got["pruned"] or 0,
    )
