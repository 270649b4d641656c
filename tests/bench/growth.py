"""Does a big database slow admissions down? `python -m tests.bench.growth [ROWS]`

The SQLite store (strict: every batch fsync'd) admits and completes calls on 32 tasks for a
few seconds on an empty database, then on one that holds ROWS (default 1,000,000) settled
receipts of 100,000 resources, each with its key record, as a busy gateway's retention
window does; then again on the empty one. It prints both rates and their ratio: the indexes
must stay cheap as the tables grow (a million rows must not halve the rate).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gateway.core.outcomes import Outcome
from gateway.store.base import Call, Refused, Replayed
from gateway.store.sqlite import SqliteStore

TASKS = 32
SECONDS = float(os.environ.get("BENCH_SECONDS", "3"))
RESOURCES = 100_000


def store_call(resource: str, key: str) -> Call:
    """An admission of a fenced call under an external issuer, as the bench's load sends."""
    return Call(
        resource=resource,
        fence=1,
        owner=None,
        client=None,
        upstream="tool",
        method="POST",
        path="/act",
        kind="call",
        mcp=None,
        issuer="external",
        idempotency_key=key,
        fingerprint="f" * 64,
        retry_statuses=frozenset(),
        retention_s=3600,
        clients_configured=False,
        serial=False,
    )


def fill(path: Path, rows: int) -> None:
    """ROWS settled receipts with their keys, written directly (no fsync per row)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    now = time.time()
    conn.execute("BEGIN")
    conn.executemany(  # each receipt its key's latest, kept 3,600 s after it settled
        "INSERT INTO receipts (id, resource, fence, upstream, method, path, idempotency_key, "
        "fingerprint, attempt, status, http_status, created_at, forwarded_at, completed_at, "
        "instance, replayable, key_retention_s, key_expires_at) VALUES "
        "(printf('00000%021d', ?1), 'fill/' || (?1 % ?2), 1, "
        "'tool', 'POST', '/act', printf('gw-%x', ?1 * 2654435761 % 4294967296) || ?1, "
        "'f', 1, 'succeeded', 200, ?3, ?3, ?3, 'old', 0, 3600, ?3 + 3600)",
        ((n, RESOURCES, now) for n in range(rows)),
    )
    conn.execute("INSERT INTO fences (resource, accepted) SELECT DISTINCT resource, 1 "
                 "FROM receipts WHERE instance = 'old' ON CONFLICT DO NOTHING")  # fmt: skip
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


async def rate(path: Path, word: str) -> float:
    """Admissions and outcomes per second, each call on one of 1,000 resources."""
    store = SqliteStore(path, instance=f"growth-{word}")
    await store.open()
    done = 0
    stop = time.monotonic() + SECONDS

    async def worker(w: int) -> None:
        nonlocal done
        n = 0
        while time.monotonic() < stop:
            n += 1
            result = await store.admit(
                store_call(f"par/{(w * 7919 + n) % 1000}", f"{word}-{w}-{n}")
            )
            assert not isinstance(result, Refused | Replayed), result
            await store.complete(result.receipt_id, Outcome("succeeded", http_status=200))
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(worker(w) for w in range(TASKS)))
    elapsed = time.monotonic() - started
    await store.close()
    return done / elapsed


async def main(rows: int) -> None:
    with tempfile.TemporaryDirectory(prefix="fence-growth-", dir=os.environ.get("TMPDIR")) as tmp:
        empty, big = Path(tmp) / "empty.db", Path(tmp) / "big.db"
        for path in (empty, big):
            store = SqliteStore(path, instance="schema")
            await store.open()
            await store.close()
        started = time.monotonic()
        fill(big, rows)
        print(f"filled {rows:,} receipts in {time.monotonic() - started:.0f} s", file=sys.stderr)
        rates: dict[str, list[float]] = {"empty": [], "big": []}
        for round_ in range(3):
            for name, path in (("empty", empty), ("big", big)):
                rates[name].append(await rate(path, f"{name}{round_}"))
        a, b = statistics.median(rates["empty"]), statistics.median(rates["big"])
        size = sum(p.stat().st_size for p in Path(tmp).glob("big.db*")) / 2**20
        print(
            f"empty database: {a:.0f} calls/s; with {rows:,} receipts ({size:.0f} MiB): "
            f"{b:.0f} calls/s; ratio {b / a:.2f} (medians of 3 rounds of {SECONDS:g} s)"
        )


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000))
