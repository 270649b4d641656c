"""Typed values from any backend's row mapping: receipts, leases, key states, owed cleanups.

Rows come back from SQL as mappings of column names; these are the one place that turns
them into the values of `gateway.core` and `gateway.store.base`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.core.cleanups import OwedCleanup
from gateway.core.idempotency import KeyState
from gateway.core.leases import Lease
from gateway.core.receipts import SETTLED
from gateway.store.base import Receipt, ReceiptQuery

RECEIPT_COLUMNS = (
    "id",
    "resource",
    "fence",
    "owner",
    "client",
    "upstream",
    "method",
    "path",
    "idempotency_key",
    "fingerprint",
    "attempt",
    "status",
    "http_status",
    "error",
    "reject_code",
    "late",
    "created_at",
    "forwarded_at",
    "completed_at",
    "instance",
    "resolution",
    "kind",
    "session",
)

RECEIPT_SELECT = ", ".join(RECEIPT_COLUMNS)
"""What a receipt read selects: never the stored answers, which can be 64 KiB each."""

SETTLED_SQL = ", ".join(f"'{status}'" for status in sorted(SETTLED))
"""The statuses retention may delete, as an SQL list."""


def receipt_filters(query: ReceiptQuery) -> list[tuple[str, object]]:
    """A receipt list's conditions as (column and operator, value) pairs, in one order for
    every backend; each renders its own placeholders."""
    conditions = (
        ("resource =", query.resource),
        ("status =", query.status),
        ("owner =", query.owner),
        ("idempotency_key =", query.idempotency_key),
        ("fence >=", query.fence_min),
        ("fence <=", query.fence_max),
        ("created_at >=", query.since),
        ("created_at <", query.until),
        ("id >", query.after_id),
    )
    return [(condition, value) for condition, value in conditions if value is not None]


def count_by_upstream(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Receipts per upstream (the rows have an `upstream` column)."""
    return dict(Counter(row["upstream"] for row in rows))


def receipt_of(row: Mapping[str, Any]) -> Receipt:
    values = {name: row[name] for name in RECEIPT_COLUMNS}
    values["late"] = bool(values["late"])
    for name in ("resolution", "session"):
        if values[name] is not None and isinstance(values[name], str):
            values[name] = json.loads(values[name])
    return Receipt(**values)


def lease_of(row: Mapping[str, Any]) -> Lease:
    return Lease(
        resource=row["resource"],
        owner=row["owner"],
        fence=row["fence"],
        state=row["state"],
        client=row["client"],
        acquire_key=row["acquire_key"],
        acquired_at=row["acquired_at"],
        renewed_at=row["renewed_at"],
        expires_at=row["expires_at"],
    )


def key_state(row: Mapping[str, Any]) -> KeyState:
    """The key's latest receipt; its answer is replayable only when stored whole and its body
    did not break afterwards (`error` set)."""
    resolution = row["resolution"]
    if isinstance(resolution, str):
        resolution = json.loads(resolution)
    return KeyState(
        receipt_id=row["id"],
        fingerprint=row["fingerprint"],
        status=row["status"],
        http_status=row["http_status"],
        attempt=row["attempt"],
        resolution=resolution["outcome"] if resolution else None,
        replayable=bool(row["replayable"]) and row["error"] is None,
    )


def owed_cleanup_of(row: Mapping[str, Any]) -> OwedCleanup:
    return OwedCleanup(
        resource=row["resource"],
        lease_fence=row["lease_fence"],
        lease_owner=row["lease_owner"],
        due_at=row["due_at"],
        attempts=row["attempts"],
        sweep_fence=row["sweep_fence"],
        last_error=row["last_error"],
    )
