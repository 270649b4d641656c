"""Receipt and lease records as the APIs show them, built from any backend's row mapping."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.store.base import rfc3339

RECEIPT_COLUMNS = (
    "id", "resource", "fence", "owner", "client", "upstream", "method", "path",
    "idempotency_key", "fingerprint", "attempt", "status", "http_status", "error",
    "reject_code", "late", "created_at", "forwarded_at", "completed_at", "instance",
    "resolution",
)
LEASE_COLUMNS = ("resource", "owner", "fence", "state", "acquired_at", "renewed_at", "expires_at")
_TIMES = frozenset({"created_at", "forwarded_at", "completed_at", "acquired_at", "renewed_at",
                    "expires_at"})


def receipt_record(row: Mapping[str, Any]) -> dict[str, Any]:
    record = {name: row[name] for name in RECEIPT_COLUMNS}
    for name in _TIMES & record.keys():
        record[name] = rfc3339(record[name])
    record["late"] = bool(record["late"])
    if record["resolution"] is not None:
        record["resolution"] = json.loads(record["resolution"])
    return record


def lease_record(row: Mapping[str, Any], now: float) -> dict[str, Any]:
    """A lease as shown: a `held` lease past its expiry is shown `expired` (store's clock)."""
    record = {name: row[name] for name in LEASE_COLUMNS}
    if record["state"] == "held" and now >= record["expires_at"]:
        record["state"] = "expired"
    for name in _TIMES & record.keys():
        record[name] = rfc3339(record[name])
    return record
