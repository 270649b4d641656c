"""A store of production size, written before its gateway starts.

Receipts are kept for `GATEWAY_RECEIPT_RETENTION_S` (7 days) and idempotency keys for a day,
so a gateway that has served even one call every two seconds holds 300,000 receipts. Whatever
the gateway does per sweep in proportion to that (a scan in the writer thread) shows up only
with such a store, and filling it through the gateway would take minutes; so the rows are
written straight into a fresh database with the gateway's own schema: completed receipts
spread over the last six days, the newest seventh of them still holding their keys.
"""

from __future__ import annotations

import sqlite3
import time
from importlib import resources
from pathlib import Path


def completed_receipts(path: Path, count: int) -> None:
    schema = resources.files("gateway.store").joinpath("schema/sqlite.sql").read_text()
    now = time.time()
    span = 6 * 86400

    def receipt(i: int) -> tuple[object, ...]:
        at = now - span * (count - i) / count
        return (f"0BENCH{i:020d}", f"old/r{i % 64}", f"key-{i}", "0" * 64, at, at, at)

    def key(i: int) -> tuple[object, ...]:
        return (f"old/r{i % 64}", f"key-{i}", f"0BENCH{i:020d}", now + 86400)

    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(schema)
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO receipts (id, resource, fence, upstream, method, path, "
            "idempotency_key, fingerprint, attempt, status, http_status, created_at, "
            "forwarded_at, completed_at, instance) VALUES "
            "(?, ?, 1, 'tool', 'POST', '/act', ?, ?, 1, 'succeeded', 200, ?, ?, ?, 'bench')",
            map(receipt, range(count)),
        )
        conn.executemany(
            "INSERT INTO idempotency_keys (resource, key, receipt_id, retention_s, expires_at) "
            "VALUES (?, ?, ?, 86400, ?)",
            map(key, range(count - count // 7, count)),
        )
        conn.execute("COMMIT")
    finally:
        conn.close()
