"""What an admission on SQLite reads (docs/contract.md §3 steps 4 and 5, §18), in one
statement: the resource's fences row, the store-wide fence floor and glob raises, its lease
(for a gateway issuer's call), the idempotency key's latest receipt while the key is kept
and, without one, how many attempts earlier receipts of the key made (the key expired).

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
from gateway.store.rows import KEY_STATE_COLUMNS, LEASE_COLUMNS, key_state, lease_of

# The receipt that holds a key (`r`): the key's latest receipt not rejected, while it keeps
# the key: until its `key_expires_at`, which is NULL while it is pending or outcome_unknown
# (schema 9: decided when the key is looked up, not by a sweep). ?1 the resource, ?2 the key,
# ?3 now. The view `idempotency_keys` spelled out, as joining the view plans a correlated
# subquery and one more search (4 to 8% slower a read, 100,000 receipts).
KEY_RECEIPT = (
    "r.id = (SELECT max(p.id) FROM receipts p WHERE p.idempotency_key = ?2 "
    "AND p.resource = ?1 AND p.status != 'rejected') AND r.key_retention_s IS NOT NULL "
    "AND (r.key_expires_at IS NULL OR r.key_expires_at > ?3)"
)

_HEAD = ("issued", "accepted", "lifted", "floor", "epoch", "raises", "pruned")
_KEY_AT = len(_HEAD)  # the key's receipt's columns, then (with a lease) the lease's
_LEASE_AT = _KEY_AT + len(KEY_STATE_COLUMNS)


def _statement(with_lease: bool) -> str:
    """The read; the lease's columns and join only for a gateway issuer's call: an
    external issuer's admission never looks at a lease (a primary-key search fewer)."""
    lease = LEASE_COLUMNS if with_lease else ()
    return (
        "SELECT f.issued, f.accepted, f.lifted, ff.floor, ff.epoch, "
        # NULL, not '[]', when there is no raise (nearly always): nothing to parse
        "(SELECT CASE WHEN count(*) THEN json_group_array(json_array(match, at_least, epoch)) "
        "END FROM fence_raises), "
        "CASE WHEN r.id IS NULL AND ?2 IS NOT NULL THEN (SELECT count(*) FROM receipts p "
        "WHERE p.idempotency_key = ?2 AND p.resource = ?1 AND p.status != 'rejected') END, "
        + ", ".join([f"r.{c}" for c in KEY_STATE_COLUMNS] + [f"l.{c}" for c in lease])
        + " FROM (SELECT 1) one "
        "LEFT JOIN fences f ON f.resource = ?1 "
        "LEFT JOIN fence_floor ff ON ff.id = 1 "
        + ("LEFT JOIN leases l ON l.resource = ?1 " if with_lease else "")
        + f"LEFT JOIN receipts r ON {KEY_RECEIPT}"
    )


_READ = {with_lease: _statement(with_lease) for with_lease in (False, True)}
# What a resource never seen, and a store never restored nor raised (nearly every store), read
# as: one value each, not a new one for every admission
_NO_ROW = FenceRow()
_NO_FLOORS = Floors()


# Not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__,
# several times the work, and this one only lives within one admission.
@dataclass(slots=True)
class AdmitRead:
    row: FenceRow
    floors: Floors
    lease: Lease | None
    latest: KeyState | None  # the key's latest receipt
    pruned: int  # without one: the attempts of the key's earlier receipts still kept


def read(
    conn: sqlite3.Connection, resource: str, key: str | None, with_lease: bool, now: float
) -> AdmitRead:
    """Everything admission decides on, for `resource` and `key` (None: a session's) at
    `now`, and the resource's lease when `with_lease`. Columns by position: a name is looked
    up in a row by comparing it with every column's."""
    got = tuple(conn.execute(_READ[with_lease], (resource, key, now)).fetchone())
    issued, accepted, lifted, floor, epoch, raises, pruned = got[:_KEY_AT]
    key_row = got[_KEY_AT:_LEASE_AT]
    lease_row = got[_LEASE_AT:]
    return AdmitRead(
        _NO_ROW if issued is None else FenceRow(issued, accepted, lifted),
        _NO_FLOORS
        if not (floor or epoch or raises)
        else floors_of(floor, epoch, raises_of_json(raises)),
        lease_of(dict(zip(LEASE_COLUMNS, lease_row, strict=True)))
        if lease_row and lease_row[0] is not None
        else None,
        key_state(dict(zip(KEY_STATE_COLUMNS, key_row, strict=True)))
        if key_row[0] is not None
        else None,
        pruned or 0,
    )
