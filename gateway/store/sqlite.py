"""The embedded store: one SQLite file in WAL mode, written by one process.

Writes go through `GroupCommitter` (one writer thread, many operations per fsync); reads use
a second connection in a thread of their own, which WAL lets run beside the writer. An flock
on the database file itself keeps a second gateway process off it: with one writer
per file, read-decide-write inside one `BEGIN IMMEDIATE` transaction is atomic.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

from gateway.core import admission
from gateway.core.errors import BY_CODE, StoreUnavailable
from gateway.store.base import (
    Admitted,
    Call,
    CleanupClaim,
    CleanupDelay,
    Outcome,
    ReceiptQuery,
    Refused,
    Rejection,
    Replayed,
    rfc3339,
    sweep_key,
)
from gateway.store.group_commit import GroupCommitter
from gateway.store.ids import MonotonicUlid
from gateway.store.rows import RECEIPT_COLUMNS, lease_record, receipt_record

PRUNE_BATCH = 1000  # receipts deleted per sweep at most; a backlog drains over sweeps
# What a receipt list reads: never the stored answers, which can be 64 KiB each.
_RECEIPT_SELECT = ", ".join(RECEIPT_COLUMNS)


class StoreLocked(Exception):
    """Another gateway process already serves this SQLite database."""


def sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


class SqliteStore:
    def __init__(self, path: Path, *, instance: str, durability: str = "strict",
                 before_commit: Callable[[], None] = lambda: None) -> None:
        self.path = path
        self.instance = instance
        self._relaxed = durability == "relaxed"
        self._before_commit = before_commit
        self._new_id = MonotonicUlid()
        self._lock_fd: int | None = None
        self._writer_pool = ThreadPoolExecutor(1, thread_name_prefix="sqlite-writer")
        self._reader_pool = ThreadPoolExecutor(1, thread_name_prefix="sqlite-reader")
        self._writer_conn: sqlite3.Connection | None = None
        self._reader_conn: sqlite3.Connection | None = None
        self.committer: GroupCommitter | None = None
        self.recovered: dict[str, int] = {}  # receipts turned outcome_unknown at start

    # -- life cycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        loop = asyncio.get_running_loop()
        self._writer_conn = await loop.run_in_executor(self._writer_pool, self._connect, False)
        self._reader_conn = await loop.run_in_executor(self._reader_pool, self._connect, True)
        # Recovery runs before the committer and outside it: failpoints model a store that
        # fails while serving, and a gateway that cannot recover must not start.
        await loop.run_in_executor(self._writer_pool, self._register_and_recover,
                                   self._writer_conn)
        self.committer = GroupCommitter(self._writer_conn, self._writer_pool,
                                        relaxed=self._relaxed, before_commit=self._before_commit)
        self.committer.start()

    async def close(self) -> None:
        if self.committer is not None:
            await self.committer.stop()
        loop = asyncio.get_running_loop()
        for pool, conn in ((self._writer_pool, self._writer_conn),
                           (self._reader_pool, self._reader_conn)):
            if conn is not None:
                await loop.run_in_executor(pool, conn.close)
            pool.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _take_lock(self) -> None:
        # The lock is on the database file itself (its inode), so another path to the same
        # file, a symlink or a hard link, meets it too. SQLite's own locks are POSIX record
        # locks, which flock does not interact with on Linux.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLocked(f"{self.path} is in use by another gateway process; a SQLite "
                              "database serves one gateway process") from None
        self._lock_fd = fd

    def _connect(self, read_only: bool) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=5)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'NORMAL' if self._relaxed else 'FULL'}")
        conn.execute("PRAGMA foreign_keys=OFF")
        if read_only:
            conn.execute("PRAGMA query_only=ON")
        else:
            schema = resources.files("gateway.store").joinpath("schema/sqlite.sql").read_text()
            conn.executescript(schema)
        return conn

    def _register_and_recover(self, conn: sqlite3.Connection) -> None:
        """At start every `pending` receipt is an earlier run's: this process holds the lock."""
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT OR REPLACE INTO instances (id, started_at, heartbeat_at) "
                     "VALUES (?, ?, ?)", (self.instance, now, now))
        self.recovered = _count_by_upstream(conn.execute(
            "UPDATE receipts SET status = 'outcome_unknown', error = 'gateway_restarted' "
            "WHERE status = 'pending' RETURNING upstream").fetchall())
        last = conn.execute("SELECT max(id) AS id FROM receipts").fetchone()["id"]
        conn.execute("COMMIT")
        if last is not None:
            self._new_id.continue_after(last)  # ids keep their order across restarts

    async def _write(self, op: Callable[[sqlite3.Connection], Any], *,
                     durable: bool = False) -> Any:
        if self.committer is None:
            raise StoreUnavailable("the store is not open")
        return await self.committer.submit(op, durable=durable)

    async def _read(self, op: Callable[[sqlite3.Connection], Any]) -> Any:
        if self._reader_conn is None:
            raise StoreUnavailable("the store is not open")
        conn = self._reader_conn
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._reader_pool, op, conn)
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the store could not be read: {exc}") from exc

    # -- admission ----------------------------------------------------------------------------

    async def admit(self, call: Call) -> Admitted | Replayed | Refused:
        return await self._write(lambda conn: self._admit(conn, call))

    def _admit(self, conn: sqlite3.Connection, call: Call) -> Admitted | Replayed | Refused:
        now = time.time()
        fences = conn.execute("SELECT issued, accepted FROM fences WHERE resource = ?",
                              (call.resource,)).fetchone()
        issued, accepted = (fences["issued"], fences["accepted"]) if fences else (0, 0)
        owner = call.owner
        if call.issuer == "gateway":
            row = conn.execute("SELECT owner, fence, client, state, expires_at FROM leases "
                               "WHERE resource = ?", (call.resource,)).fetchone()
            lease = None if row is None else admission.LeaseState(
                owner=row["owner"], fence=row["fence"], client=row["client"],
                held=row["state"] == "held" and now < row["expires_at"])
            code = admission.check_gateway_fence(call.fence, issued, lease, call.owner,
                                                 call.client, call.clients_configured)
            if lease is not None and lease.fence == call.fence:
                owner = lease.owner
        else:
            code = admission.check_external_fence(call.fence, accepted)
        if code is not None:
            return Refused(code, self._insert_rejected(conn, call, owner, code, now, False))

        conn.execute(
            "INSERT INTO fences (resource, accepted) VALUES (?, ?) ON CONFLICT (resource) "
            "DO UPDATE SET accepted = max(accepted, excluded.accepted)",
            (call.resource, call.fence))

        latest = self._key_state(conn, call.resource, call.idempotency_key)
        decision = admission.decide_idempotency(latest, call.fingerprint, call.retry_statuses)
        if latest is None:
            # A key pruned after its retention may still have receipts: SPEC 4 counts them.
            earlier = conn.execute(
                "SELECT count(*) FROM receipts WHERE idempotency_key = ? AND resource = ? "
                "AND status != 'rejected'", (call.idempotency_key, call.resource)).fetchone()[0]
            decision = admission.NewAttempt(1 + earlier)
        if isinstance(decision, admission.Replay):
            stored = conn.execute("SELECT http_status, response_headers, response_body "
                                  "FROM receipts WHERE id = ?", (decision.receipt_id,)).fetchone()
            return Replayed(decision.receipt_id, stored["http_status"],
                            [tuple(h) for h in json.loads(stored["response_headers"])],
                            bytes(stored["response_body"]))
        if isinstance(decision, admission.Refuse):
            receipt_id = self._insert_rejected(conn, call, owner, decision.code, now, True)
            return Refused(decision.code, receipt_id, decision.receipt_id)

        receipt_id = self._new_id(now)
        conn.execute(
            "INSERT INTO receipts (id, resource, fence, owner, client, upstream, method, path, "
            "idempotency_key, fingerprint, attempt, status, created_at, forwarded_at, instance) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?, ?)",
            (receipt_id, call.resource, call.fence, owner, call.client, call.upstream,
             call.method, call.path, call.idempotency_key, call.fingerprint, decision.attempt,
             now, now, self.instance))
        conn.execute(
            "INSERT INTO idempotency_keys (resource, key, receipt_id, retention_s, expires_at) "
            "VALUES (?, ?, ?, ?, NULL) ON CONFLICT (resource, key) DO UPDATE SET "
            "receipt_id = excluded.receipt_id, retention_s = excluded.retention_s, "
            "expires_at = NULL",
            (call.resource, call.idempotency_key, receipt_id, call.retention_s))
        return Admitted(receipt_id, decision.attempt, owner)

    def _key_state(self, conn: sqlite3.Connection, resource: str,
                   key: str) -> admission.KeyState | None:
        row = conn.execute(
            "SELECT r.id, r.fingerprint, r.status, r.http_status, r.replayable, r.resolution, "
            "r.attempt, r.error FROM idempotency_keys k JOIN receipts r ON r.id = k.receipt_id "
            "WHERE k.resource = ? AND k.key = ?", (resource, key)).fetchone()
        if row is None:
            return None
        resolution = json.loads(row["resolution"])["outcome"] if row["resolution"] else None
        return admission.KeyState(
            receipt_id=row["id"], fingerprint=row["fingerprint"], status=row["status"],
            http_status=row["http_status"], resolution=resolution, attempt=row["attempt"],
            replayable=bool(row["replayable"]) and row["error"] is None)

    def _insert_rejected(self, conn: sqlite3.Connection, call: Call, owner: str | None,
                         code: str, now: float, with_key: bool) -> str:
        return self._insert_rejection(conn, Rejection(
            resource=call.resource, fence=call.fence, owner=owner, client=call.client,
            upstream=call.upstream, method=call.method, path=call.path, code=code,
            http_status=BY_CODE[code].status), now,
            call.idempotency_key if with_key else None, call.fingerprint if with_key else None)

    def _insert_rejection(self, conn: sqlite3.Connection, rejection: Rejection, now: float,
                          key: str | None = None, fingerprint: str | None = None) -> str:
        receipt_id = self._new_id(now)
        conn.execute(
            "INSERT INTO receipts (id, resource, fence, owner, client, upstream, method, path, "
            "idempotency_key, fingerprint, status, http_status, reject_code, created_at, "
            "completed_at, instance) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'rejected', ?, ?, ?, ?, ?)",
            (receipt_id, rejection.resource, rejection.fence, rejection.owner, rejection.client,
             rejection.upstream, rejection.method, rejection.path, key, fingerprint,
             rejection.http_status, rejection.code, now, now, self.instance))
        return receipt_id

    async def reject(self, rejection: Rejection) -> str:
        return await self._write(
            lambda conn: self._insert_rejection(conn, rejection, time.time()))

    # -- outcomes -----------------------------------------------------------------------------

    async def complete(self, receipt_id: str, outcome: Outcome) -> str:
        """Record an outcome; returns 'recorded', 'late' or 'late_outcome' (SPEC 3)."""
        return await self._write(lambda conn: self._complete(conn, receipt_id, outcome))

    def _complete(self, conn: sqlite3.Connection, receipt_id: str, outcome: Outcome) -> str:
        now = time.time()
        row = conn.execute("SELECT status, resource, idempotency_key FROM receipts "
                           "WHERE id = ?", (receipt_id,)).fetchone()
        if row is None:
            return "missing"
        status = row["status"]
        late = status in ("outcome_unknown", "reconciled")
        if late and outcome.status not in ("succeeded", "failed"):
            return "late"  # a second "unknown" (or not_sent) teaches nothing: keep the receipt
        if status == "reconciled":
            # The resolution stands; the tool's own answer is kept beside it for the alert.
            conn.execute("UPDATE receipts SET error = 'late_outcome', late = 1, "
                         "http_status = ? WHERE id = ?", (outcome.http_status, receipt_id))
            return "late_outcome"
        if status not in ("pending", "outcome_unknown"):
            return "recorded"  # already final: an outcome is recorded once
        headers, body = outcome.response if outcome.response is not None else (None, None)
        conn.execute(
            "UPDATE receipts SET status = ?, http_status = ?, error = ?, late = ?, "
            "forwarded_at = ?, completed_at = ?, replayable = ?, response_headers = ?, "
            "response_body = ? WHERE id = ?",
            (outcome.status, outcome.http_status, outcome.error, int(late),
             outcome.forwarded_at, now, int(outcome.response is not None),
             json.dumps(headers) if headers is not None else None, body, receipt_id))
        if outcome.status != "outcome_unknown":
            self._settle_key(conn, row["resource"], row["idempotency_key"], receipt_id, now)
        return "late" if late else "recorded"

    @staticmethod
    def _settle_key(conn: sqlite3.Connection, resource: str, key: str | None,
                    receipt_id: str, now: float) -> None:
        """The key's retention starts once its latest receipt is settled."""
        conn.execute("UPDATE idempotency_keys SET expires_at = ? + retention_s "
                     "WHERE resource = ? AND key = ? AND receipt_id = ?",
                     (now, resource, key, receipt_id))

    async def mark_forwarded(self, receipt_id: str) -> None:
        """The call leaves now, later than its admission (it waited for older calls): the
        time a reconciler must wait counts from here, so this is durable before it leaves."""
        await self._write(lambda conn: conn.execute(
            "UPDATE receipts SET forwarded_at = ? WHERE id = ? AND status = 'pending'",
            (time.time(), receipt_id)))

    async def mark_incomplete(self, receipt_id: str) -> None:
        await self._write(lambda conn: conn.execute(
            "UPDATE receipts SET error = 'response_incomplete', replayable = 0, "
            "response_headers = NULL, response_body = NULL WHERE id = ?", (receipt_id,)))

    async def resolve(self, receipt_id: str, outcome: str, source: str, note: str | None,
                      wait_s: dict[str, float], default_wait_s: float) -> dict[str, Any] | str:
        """Reconcile an `outcome_unknown` receipt past its grace; the receipt, or why not."""

        def op(conn: sqlite3.Connection) -> dict[str, Any] | str:
            now = time.time()
            row = conn.execute("SELECT * FROM receipts WHERE id = ?", (receipt_id,)).fetchone()
            if row is None:
                return "not_found"
            started = row["forwarded_at"] or row["created_at"]
            if row["status"] != "outcome_unknown" or \
                    now < started + wait_s.get(row["upstream"], default_wait_s):
                return "not_reconcilable"
            resolution = {"outcome": outcome, "source": source, "note": note,
                          "at": rfc3339(now)}
            conn.execute("UPDATE receipts SET status = 'reconciled', resolution = ?, "
                         "completed_at = coalesce(completed_at, ?) WHERE id = ?",
                         (json.dumps(resolution), now, receipt_id))
            self._settle_key(conn, row["resource"], row["idempotency_key"], receipt_id, now)
            updated = conn.execute("SELECT * FROM receipts WHERE id = ?",
                                   (receipt_id,)).fetchone()
            return receipt_record(updated)

        return await self._write(op)

    # -- reads --------------------------------------------------------------------------------

    async def get_receipt(self, receipt_id: str) -> dict[str, Any] | None:
        def op(conn: sqlite3.Connection) -> dict[str, Any] | None:
            row = conn.execute("SELECT * FROM receipts WHERE id = ?", (receipt_id,)).fetchone()
            return receipt_record(row) if row else None

        return await self._read(op)

    async def list_receipts(self, query: ReceiptQuery) -> list[dict[str, Any]]:
        clauses, params = [], []
        for column, value in (("resource", query.resource), ("status", query.status),
                              ("owner", query.owner),
                              ("idempotency_key", query.idempotency_key)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        for clause, value in (("fence >= ?", query.fence_min), ("fence <= ?", query.fence_max),
                              ("created_at >= ?", query.since), ("created_at < ?", query.until),
                              ("id > ?", query.after_id)):
            if value is not None:
                clauses.append(clause)
                params.append(value)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        sql = f"SELECT {_RECEIPT_SELECT} FROM receipts {where} ORDER BY id LIMIT ?"
        params.append(query.limit)
        return await self._read(
            lambda conn: [receipt_record(r) for r in conn.execute(sql, params).fetchall()])

    # -- leases (SPEC 6) ----------------------------------------------------------------------

    async def acquire(self, resource: str, owner: str, ttl_s: float, lock_delay_s: float,
                      client: str | None, acquire_key: str | None) -> tuple[str, dict[str, Any],
                                                                             float | None]:
        """Compare-and-swap acquire: ('acquired'|'retried'|'held', lease, held_seconds).

        `held_seconds` is how long the lease that was taken over had been held, for metrics.
        Always durable, also in relaxed mode.
        """
        return await self._write(
            lambda conn: self._acquire(conn, resource, owner, ttl_s, lock_delay_s, client,
                                       acquire_key), durable=True)

    def _acquire(self, conn: sqlite3.Connection, resource: str, owner: str, ttl_s: float,
                 lock_delay_s: float, client: str | None,
                 acquire_key: str | None) -> tuple[str, dict[str, Any], float | None]:
        """The acquire CAS inside a transaction (also the sweeper's claim uses it)."""
        now = time.time()
        row = conn.execute("SELECT * FROM leases WHERE resource = ?", (resource,)).fetchone()
        held_seconds = None
        if row is not None:
            live = row["state"] == "held" and now < row["expires_at"]
            # A retry answers with the lease it made only while that lease lives: handing
            # back an expired or released lease would give the client a dead fence.
            if (live and acquire_key is not None and row["acquire_key"] == acquire_key
                    and row["client"] == client and row["owner"] == owner):
                return "retried", lease_record(row, now), None
            free = row["state"] == "released" or now >= row["expires_at"] + lock_delay_s
            if not free:
                return "held", lease_record(row, now), None
            if row["state"] == "held":  # taken over before the sweeper marked it expired
                held_seconds = row["expires_at"] - row["acquired_at"]
        fences = conn.execute("SELECT issued, accepted FROM fences WHERE resource = ?",
                              (resource,)).fetchone()
        fence = max(fences["issued"], fences["accepted"]) + 1 if fences else 1
        conn.execute("INSERT INTO fences (resource, issued) VALUES (?, ?) "
                     "ON CONFLICT (resource) DO UPDATE SET issued = excluded.issued",
                     (resource, fence))
        conn.execute(
            "INSERT OR REPLACE INTO leases (resource, owner, fence, client, acquire_key, "
            "state, acquired_at, renewed_at, expires_at, ended_at) "
            "VALUES (?, ?, ?, ?, ?, 'held', ?, ?, ?, NULL)",
            (resource, owner, fence, client, acquire_key, now, now, now + ttl_s))
        new = conn.execute("SELECT * FROM leases WHERE resource = ?", (resource,)).fetchone()
        return "acquired", lease_record(new, now), held_seconds

    async def renew(self, resource: str, owner: str, fence: int, ttl_s: float,
                    client: str | None = None) -> dict[str, Any] | None:
        """The renewed lease, or None when it is lost (not ours, expired or released).

        Only the client that acquired a lease may renew it (`client` None: running open)."""

        def op(conn: sqlite3.Connection) -> dict[str, Any] | None:
            now = time.time()
            cursor = conn.execute(
                "UPDATE leases SET renewed_at = ?, expires_at = ? WHERE resource = ? AND "
                "owner = ? AND fence = ? AND client IS ? AND state = 'held' AND expires_at > ?",
                (now, now + ttl_s, resource, owner, fence, client, now))
            if cursor.rowcount == 0:
                return None
            row = conn.execute("SELECT * FROM leases WHERE resource = ?", (resource,)).fetchone()
            return lease_record(row, now)

        return await self._write(op)

    async def release(self, resource: str, owner: str | None, fence: int | None,
                      client: str | None = None) -> tuple[bool, float | None]:
        """(ok, held_seconds). With owner and fence None: an admin's revoke.

        Releasing a lease its holder already released, or that expired untaken, is ok. A
        release after expiry leaves the lease to the sweeper, which marks it expired and
        schedules its `on_expiry` cleanup as for any expiry.
        """

        def op(conn: sqlite3.Connection) -> tuple[bool, float | None]:
            now = time.time()
            row = conn.execute("SELECT * FROM leases WHERE resource = ?", (resource,)).fetchone()
            if row is None:
                return owner is None, None
            if owner is not None and (row["owner"] != owner or row["fence"] != fence
                                      or row["client"] != client):
                return False, None
            if row["state"] != "held":
                if owner is None and row["state"] == "expired":
                    # a revoke frees the resource at once: no lock delay after it
                    conn.execute("UPDATE leases SET state = 'released' WHERE resource = ?",
                                 (resource,))
                return True, None
            if owner is not None and now >= row["expires_at"]:
                return True, None  # expired untaken: the sweeper's to mark and clean up after
            held = min(now, row["expires_at"]) - row["acquired_at"]
            conn.execute("UPDATE leases SET state = 'released', ended_at = ? WHERE resource = ?",
                         (now, resource))
            return True, held

        return await self._write(op)

    async def get_lease(self, resource: str) -> dict[str, Any] | None:
        def op(conn: sqlite3.Connection) -> dict[str, Any] | None:
            row = conn.execute("SELECT * FROM leases WHERE resource = ?", (resource,)).fetchone()
            return lease_record(row, time.time()) if row else None

        return await self._read(op)

    async def list_leases(self, prefix: str | None, state: str | None, after: str | None,
                          limit: int) -> list[dict[str, Any]]:
        def op(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            now = time.time()
            clauses, params = [], []
            if prefix:
                clauses.append("substr(resource, 1, ?) = ?")
                params += [len(prefix), prefix]
            if after is not None:
                clauses.append("resource > ?")
                params.append(after)
            if state == "held":
                clauses.append("state = 'held' AND expires_at > ?")
                params.append(now)
            elif state == "expired":
                clauses.append("(state = 'expired' OR (state = 'held' AND expires_at <= ?))")
                params.append(now)
            elif state == "released":
                clauses.append("state = 'released'")
            where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
            rows = conn.execute(f"SELECT * FROM leases {where} ORDER BY resource LIMIT ?",
                                [*params, limit]).fetchall()
            return [lease_record(r, now) for r in rows]

        return await self._read(op)

    async def expire_leases(self, cleanup_delay: CleanupDelay | None = None,
                            ) -> list[dict[str, Any]]:
        """Mark held leases past expiry `expired`; the ones this call marked, with held time.

        `cleanup_delay(resource, owner)` says which of them owe a sweeper cleanup (SPEC 9)
        and after what lock delay: those are scheduled in the same transaction, so a crash
        between the two can never lose one.
        """

        def op(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            now = time.time()
            rows = conn.execute("SELECT * FROM leases WHERE state = 'held' AND expires_at <= ?",
                                (now,)).fetchall()
            conn.execute("UPDATE leases SET state = 'expired', ended_at = ? "
                         "WHERE state = 'held' AND expires_at <= ?", (now, now))
            if cleanup_delay is not None:
                self._schedule_cleanups(conn, rows, cleanup_delay, now)
            return [{**lease_record(r, now),
                     "held_seconds": r["expires_at"] - r["acquired_at"]} for r in rows]

        return await self._write(op)

    # -- sweeper cleanups (SPEC 9) ---------------------------------------------------------
    # A row in `cleanups` is a rule's `on_expiry` call still owed for a resource. It is written
    # in the transaction that marks the lease expired and deleted only once the call is known
    # to have happened (or a new owner took the resource over), so neither a failed call nor
    # a restart loses one. The claim re-checks everything in one transaction and takes the
    # sweeper's lease with the acquire CAS: with several sweepers, one call per attempt.

    def _schedule_cleanups(self, conn: sqlite3.Connection, rows: list[sqlite3.Row],
                           cleanup_delay: CleanupDelay, now: float) -> None:
        for row in rows:
            delay = cleanup_delay(row["resource"], row["owner"])
            if delay is None:
                continue
            # A newer expiry replaces an older owed cleanup: whoever held the resource in
            # between superseded it, and the newest lease is the one to clean up after.
            conn.execute(
                "INSERT INTO cleanups (resource, lease_fence, lease_owner, due_at, attempts, "
                "sweep_fence, last_error, created_at) VALUES (?, ?, ?, ?, 0, NULL, NULL, ?) "
                "ON CONFLICT (resource) DO UPDATE SET lease_fence = excluded.lease_fence, "
                "lease_owner = excluded.lease_owner, due_at = excluded.due_at, attempts = 0, "
                "sweep_fence = NULL, last_error = NULL, created_at = excluded.created_at",
                (row["resource"], row["fence"], row["owner"], row["expires_at"] + delay, now))

    async def due_cleanups(self, limit: int) -> list[str]:
        """Resources whose owed cleanup is due now, the longest due first."""
        return await self._read(lambda conn: [row["resource"] for row in conn.execute(
            "SELECT resource FROM cleanups WHERE due_at <= ? ORDER BY due_at LIMIT ?",
            (time.time(), limit)).fetchall()])

    async def list_cleanups(self) -> list[dict[str, Any]]:
        """Every owed cleanup, for operators and tests."""
        return await self._read(lambda conn: [dict(row) for row in conn.execute(
            "SELECT * FROM cleanups ORDER BY resource").fetchall()])

    async def claim_cleanup(self, resource: str, owner: str, ttl_s: float, lock_delay_s: float,
                            recheck_s: float) -> CleanupClaim:
        """Decide the next step of an owed cleanup and, when it is to be tried, acquire the
        resource as `owner` (a new fence). Durable like every acquire.

        `recheck_s`: how long to leave the row alone when it must wait (an earlier attempt's
        outcome is unknown, or the resource is still held).
        """
        return await self._write(
            lambda conn: self._claim_cleanup(conn, resource, owner, ttl_s, lock_delay_s,
                                             recheck_s), durable=True)

    def _claim_cleanup(self, conn: sqlite3.Connection, resource: str, owner: str, ttl_s: float,
                       lock_delay_s: float, recheck_s: float) -> CleanupClaim:
        now = time.time()
        row = conn.execute("SELECT * FROM cleanups WHERE resource = ?", (resource,)).fetchone()
        if row is None or now < row["due_at"]:
            return CleanupClaim("not_due")
        later = ("UPDATE cleanups SET due_at = ? WHERE resource = ?", (now + recheck_s, resource))
        if row["sweep_fence"] is not None:
            earlier = self._key_state(conn, resource, sweep_key(row["sweep_fence"]))
            if earlier is not None and earlier.status in ("pending", "outcome_unknown"):
                conn.execute(*later)
                return CleanupClaim("waiting", receipt_id=earlier.receipt_id)
            if earlier is not None and (earlier.status == "succeeded" or (
                    earlier.status == "reconciled" and earlier.resolution != "not_applied")):
                conn.execute("DELETE FROM cleanups WHERE resource = ?", (resource,))
                return CleanupClaim("done", receipt_id=earlier.receipt_id)
        # Still owed. The lease must be the one this cleanup follows (the expired owner's, or
        # the sweeper's last attempt); anything newer means a new owner took the resource.
        expected = row["sweep_fence"] or row["lease_fence"]
        lease = conn.execute("SELECT owner, fence FROM leases WHERE resource = ?",
                             (resource,)).fetchone()
        if lease is None or lease["fence"] != expected:
            conn.execute("DELETE FROM cleanups WHERE resource = ?", (resource,))
            return CleanupClaim("superseded", holder=lease["owner"] if lease else None)
        result, record, _ = self._acquire(conn, resource, owner, ttl_s, lock_delay_s, None, None)
        if result != "acquired":
            conn.execute(*later)
            return CleanupClaim("busy", holder=record["owner"])
        conn.execute("UPDATE cleanups SET sweep_fence = ?, attempts = attempts + 1 "
                     "WHERE resource = ?", (record["fence"], resource))
        return CleanupClaim("claimed", fence=record["fence"], key=sweep_key(record["fence"]),
                            attempt=row["attempts"] + 1, lease_fence=row["lease_fence"],
                            lease_owner=row["lease_owner"])

    async def finish_cleanup(self, resource: str, fence: int, done: bool,
                             retry_at: float | None = None, error: str | None = None) -> None:
        """After attempt `fence`: forget the cleanup when `done`, else note why and when to
        look again. A row a newer expiry replaced meanwhile is left alone."""

        def op(conn: sqlite3.Connection) -> None:
            if done:
                conn.execute("DELETE FROM cleanups WHERE resource = ? AND sweep_fence = ?",
                             (resource, fence))
            else:
                conn.execute("UPDATE cleanups SET due_at = ?, last_error = ? "
                             "WHERE resource = ? AND sweep_fence = ?",
                             (retry_at if retry_at is not None else time.time(), error,
                              resource, fence))

        await self._write(op)

    async def drop_cleanup(self, resource: str) -> None:
        """Forget an owed cleanup (its rule no longer has `on_expiry`)."""
        await self._write(lambda conn: conn.execute("DELETE FROM cleanups WHERE resource = ?",
                                                    (resource,)))

    # -- upkeep (SPEC 9) ----------------------------------------------------------------------

    async def heartbeat(self) -> None:
        await self._write(lambda conn: conn.execute(
            "UPDATE instances SET heartbeat_at = ? WHERE id = ?", (time.time(), self.instance)))

    async def expire_pending(self, wait_s: dict[str, float], default_wait_s: float,
                             silent_after_s: float,
                             in_flight: frozenset[str]) -> dict[str, int]:
        """Turn lost `pending` receipts `outcome_unknown`: their instance fell silent, or
        they are older than their upstream's timeout plus grace (`wait_s`). Receipts this
        process still has in flight are not lost, whatever their age. How many, by upstream."""

        def op(conn: sqlite3.Connection) -> dict[str, int]:
            now = time.time()
            rows = conn.execute(
                "SELECT r.id, r.upstream, r.created_at, r.forwarded_at, i.heartbeat_at "
                "FROM receipts r LEFT JOIN instances i ON i.id = r.instance "
                "WHERE r.status = 'pending'").fetchall()
            lost = [
                row for row in rows if row["id"] not in in_flight and (
                    row["heartbeat_at"] is None or row["heartbeat_at"] < now - silent_after_s
                    or (row["forwarded_at"] or row["created_at"])
                    + wait_s.get(row["upstream"], default_wait_s) < now)
            ]
            conn.executemany("UPDATE receipts SET status = 'outcome_unknown', error = "
                             "'outcome_not_recorded' WHERE id = ? AND status = 'pending'",
                             [(row["id"],) for row in lost])
            return _count_by_upstream(lost)

        return await self._write(op)

    async def prune(self, receipt_retention_s: float) -> int:
        def op(conn: sqlite3.Connection) -> int:
            now = time.time()
            conn.execute("DELETE FROM idempotency_keys WHERE expires_at < ?", (now,))
            # Index range seeks only, and a bounded batch: this runs in the writer thread,
            # where every admission waits behind it.
            cursor = conn.execute(
                "DELETE FROM receipts WHERE id IN (SELECT r.id FROM receipts r WHERE r.status "
                "IN ('succeeded', 'failed', 'not_sent', 'rejected', 'reconciled') AND "
                "r.completed_at < ? AND NOT EXISTS (SELECT 1 FROM idempotency_keys k "
                "WHERE k.receipt_id = r.id) LIMIT ?)",
                (now - receipt_retention_s, PRUNE_BATCH))
            return cursor.rowcount

        return await self._write(op)

    async def oldest_unknown_age(self) -> float:
        def op(conn: sqlite3.Connection) -> float:
            row = conn.execute("SELECT min(created_at) AS t FROM receipts "
                               "WHERE status = 'outcome_unknown'").fetchone()
            return time.time() - row["t"] if row["t"] is not None else 0.0

        return await self._read(op)



def _count_by_upstream(rows: list[sqlite3.Row]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["upstream"]] = counts.get(row["upstream"], 0) + 1
    return counts
