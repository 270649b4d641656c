"""The embedded store: one SQLite file in WAL mode, written by one process.

Writes go through `GroupCommitter` (many operations per fsync, run on the event loop and
committed by a writer thread); reads use a second connection in a thread of their own, which
WAL lets run beside the writer. An flock on the database file itself keeps a second gateway
process off it: with one writer per file, read-decide-write inside one `BEGIN IMMEDIATE`
transaction is atomic.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import TypeVar

from gateway.core import checkpoints, cleanups, fences, floors, idempotency, leases, outcomes
from gateway.core.errors import StoreUnavailable
from gateway.core.fences import Issuer
from gateway.core.receipts import ReconcileWaits, Resolution, may_resolve
from gateway.core.times import Clock
from gateway.store import checkpoint_rows as cp
from gateway.store import sqlite_admit, sqlite_floors
from gateway.store.base import (
    AcquireResult,
    Admitted,
    Call,
    Checkpoint,
    CheckpointRefused,
    CheckpointWritten,
    CleanupClaim,
    CleanupDelay,
    Completion,
    EpochChange,
    FenceState,
    Lease,
    NewCheckpoint,
    Outcome,
    OwedCleanup,
    Receipt,
    ReceiptPage,
    ReceiptQuery,
    Refused,
    Rejection,
    Release,
    Replayed,
    ResolveRefused,
    RestoreReport,
    RunRecords,
    SessionRecord,
    shown,
)
from gateway.store.group_commit import GroupCommitter
from gateway.store.ids import MonotonicUlid, id_ceiling
from gateway.store.rows import (
    KEY_STATE_SELECT,
    RECEIPT_SELECT,
    REJECTED_COLUMNS,
    SETTLED_SQL,
    count_by_upstream,
    key_state,
    lease_of,
    lost_receipts,
    mcp_json,
    outcome_columns,
    owed_cleanup_of,
    owed_cleanup_rows,
    receipt_conditions,
    receipt_of,
    rejected_values,
    replayed_of,
    resolution_json,
    session_json,
    where,
)

T = TypeVar("T")

# The sqlite3 module binds an int, float or str parameter as it is, but looks every other one
# (None, bytes) up as a value to adapt first, and that lookup fails by raising and clearing
# an AttributeError, with its message formatted: about 4,000 instructions a parameter, and an
# admission binds several None (owner, client, mcp, trace_id) and an outcome a body. A
# registered adapter is found by the first step of that lookup. Each gives the value back as
# it was, so what is bound, and stored, is the same: NULL for None, a BLOB for bytes.
_NOTHING: dict[None, None] = {}  # its `get`: a C function that answers None for None
sqlite3.register_adapter(type(None), _NOTHING.get)
sqlite3.register_adapter(bytes, bytes)  # bytes(b) is b itself

# Retention deletes in small batches, each its own write, so admissions queued behind one
# wait for a few hundred rows at most; a sweep deletes PRUNE_BATCH * PRUNE_BATCHES rows at
# most, and a backlog drains over sweeps.
PRUNE_BATCH = 200
PRUNE_BATCHES = 50
# The WAL is folded back into the database by the writer between batches, never inside a
# commit (SQLite's automatic checkpoint runs inside the commit that crosses its threshold):
# a PASSIVE checkpoint once this many rows were written since the last (about what SQLite's
# own 1,000 pages hold), and a TRUNCATE one, which waits for readers, once the WAL holds
# more than WAL_MAX_FRAMES pages all the same (a reader kept it from being reset).
CHECKPOINT_AFTER_CHANGES = 2000
WAL_MAX_FRAMES = 16384  # 64 MiB of 4 KiB pages
WAL_SIZE_LIMIT = 64 * 1024 * 1024  # the WAL file is cut back to this after a reset
PAGE_CACHE_KIB = 64 * 1024  # the writer's page cache: the hot indexes' pages stay in memory
SCHEMA_VERSION = 9
"""The newest schema this code knows: `schema/sqlite.sql` is version 1, and
`schema/sqlite-{n}.sql` takes a database from n - 1 to n (`PRAGMA user_version`)."""
_IN_LIST_MAX = 500  # resources per `IN (...)`: well below SQLite's variable limit
_KEY_STATE = f"SELECT {KEY_STATE_SELECT} FROM receipts r WHERE {sqlite_admit.KEY_RECEIPT}"


# The outcome, and with it the key's retention from now when the outcome settles it (the
# last parameter): the key is the receipt's own, so one row takes both.
_RECORD_OUTCOME = (
    "UPDATE receipts SET status = ?1, http_status = ?2, error = ?3, late = ?4, "
    "forwarded_at = CASE WHEN ?5 IS NOT NULL THEN coalesce(forwarded_at, ?5) END, "
    "completed_at = ?6, replayable = ?7, response_headers = ?8, "
    "response_body = ?9, session = coalesce(?10, session), "
    "key_expires_at = CASE WHEN ?12 THEN ?6 + key_retention_s ELSE key_expires_at END "
    "WHERE id = ?11"
)


def _q(_: int) -> str:
    return "?"


def _checkpoint_values(c: Checkpoint) -> tuple[object, ...]:
    return (c.resource, c.seq, c.fence, c.owner, c.client, c.step, c.state, c.at, c.mark)


class StoreLocked(Exception):
    """Another gateway process already serves this SQLite database."""


class SchemaTooNew(Exception):
    """The database was written by a newer gateway: this one must not serve it."""


def _refuse_newer(conn: sqlite3.Connection) -> None:
    """Raise `SchemaTooNew` for a database a newer gateway wrote."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(
            f"the SQLite schema is version {version}, newer than this gateway knows "
            f"({SCHEMA_VERSION}): upgrade the gateway"
        )


def sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


def lock_database(path: Path) -> int:
    """Take the database's process lock (an flock), or raise `StoreLocked`; the descriptor
    holds it until closed. `fence-gateway restore` takes it too, so it never replaces a
    database a gateway serves."""
    # The lock is on the database file itself (its inode), so another path to the same
    # file, a symlink or a hard link, meets it too. SQLite's own locks are POSIX record
    # locks, which flock does not interact with on Linux.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLocked(
            f"{path} is in use by another gateway process; a SQLite "
            "database serves one gateway process"
        ) from None
    return fd


class SqliteStore:
    shared = False  # one process per database: its lanes see every call in flight
    writes_in_order = True  # one group committer, first come first committed
    open_warnings: tuple[tuple[str, str], ...] = ()

    def __init__(
        self,
        path: Path,
        *,
        instance: str,
        durability: str = "strict",
        before_commit: Callable[[], None] = lambda: None,
        active_calls: Callable[[], int] | None = None,
        clock: Clock = time.time,
    ) -> None:
        """`active_calls`: the server's count of the calls at work (in progress, not waiting
        for a turn), which lets a batch that is all the work there is commit on the event
        loop's thread (`GroupCommitter`)."""
        self.path = path
        self._now = clock
        self.instance = instance
        self._relaxed = durability == "relaxed"
        self._before_commit = before_commit
        self._active_calls = active_calls
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
        await loop.run_in_executor(self._writer_pool, self._register_and_recover, self._writer_conn)
        self._checkpointed_at = self._writer_conn.total_changes
        self.committer = GroupCommitter(
            self._writer_conn,
            self._writer_pool,
            relaxed=self._relaxed,
            before_commit=self._before_commit,
            between_batches=self._checkpoint_when_due,
            upkeep_due=self._checkpoint_due,
            active_calls=self._active_calls,
        )
        self.committer.start()

    async def close(self) -> None:
        if self.committer is not None:
            await self.committer.stop()
        loop = asyncio.get_running_loop()
        for pool, conn in (
            (self._writer_pool, self._writer_conn),
            (self._reader_pool, self._reader_conn),
        ):
            if conn is not None:
                await loop.run_in_executor(pool, conn.close)
            pool.shutdown(wait=True)
        # closed: a read or a write from now on is refused as unavailable, and a second
        # close does nothing
        self._writer_conn = self._reader_conn = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _take_lock(self) -> None:
        self._lock_fd = lock_database(self.path)

    def _connect(self, read_only: bool) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5)
        conn.row_factory = sqlite3.Row
        if not read_only:
            try:
                _refuse_newer(conn)  # before anything is written, the switch to WAL included
            except SchemaTooNew:
                conn.close()
                raise
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'NORMAL' if self._relaxed else 'FULL'}")
        conn.execute("PRAGMA foreign_keys=OFF")
        if read_only:
            conn.execute("PRAGMA query_only=ON")
        else:
            conn.execute("PRAGMA wal_autocheckpoint=0")  # the writer's own, between batches
            conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            conn.execute(f"PRAGMA cache_size=-{PAGE_CACHE_KIB}")
            self._migrate(conn)
        return conn

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        """Bring the schema to `SCHEMA_VERSION`, one version per transaction (a database of
        a newer gateway was refused already: `_refuse_newer`). A new database, and one from
        before versioning, reads 0: the base schema (version 1, all `IF NOT EXISTS`) makes
        sure of it first. Only then: a later version may drop what the base schema would
        make again."""
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            conn.executescript(
                resources.files("gateway.store").joinpath("schema/sqlite.sql").read_text()
            )
            version = 1
        for step in range(version + 1, SCHEMA_VERSION + 1):
            script = resources.files("gateway.store").joinpath(f"schema/sqlite-{step}.sql")
            conn.executescript(
                f"BEGIN IMMEDIATE; {script.read_text()}\nPRAGMA user_version = {step}; COMMIT;"
            )

    def _register_and_recover(self, conn: sqlite3.Connection) -> None:
        """At start every `pending` receipt is an earlier run's: this process holds the lock."""
        now = self._now()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT OR REPLACE INTO instances (id, started_at, heartbeat_at) VALUES (?, ?, ?)",
            (self.instance, now, now),
        )
        self.recovered = count_by_upstream(
            conn.execute(
                "UPDATE receipts SET status = 'outcome_unknown', error = 'gateway_restarted' "
                "WHERE status = 'pending' RETURNING upstream"
            ).fetchall()
        )
        last = conn.execute("SELECT max(id) AS id FROM receipts").fetchone()["id"]
        conn.execute("COMMIT")
        if last is not None:
            self._new_id.continue_after(last)  # ids keep their order across restarts

    def _checkpoint_due(self) -> bool:
        conn = self._writer_conn
        assert conn is not None
        return conn.total_changes - self._checkpointed_at >= CHECKPOINT_AFTER_CHANGES

    def _checkpoint_when_due(self) -> None:
        """In the writer thread, between batches (`GroupCommitter`)."""
        conn = self._writer_conn
        assert conn is not None
        if not self._checkpoint_due():
            return
        self._checkpointed_at = conn.total_changes
        _, frames, _ = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        if frames > WAL_MAX_FRAMES:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()

    async def _write(
        self,
        op: Callable[[sqlite3.Connection], T],
        *,
        durable: bool = False,
        bulk: bool = False,
        of_call: bool = False,
    ) -> T:
        if self.committer is None:
            raise StoreUnavailable("the store is not open")
        result: T = await self.committer.submit(op, durable=durable, bulk=bulk, of_call=of_call)
        return result

    async def _read(self, op: Callable[[sqlite3.Connection], T]) -> T:
        if self._reader_conn is None:
            raise StoreUnavailable("the store is not open")
        conn = self._reader_conn
        try:
            return await asyncio.get_running_loop().run_in_executor(self._reader_pool, op, conn)
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the store could not be read: {exc}") from exc

    # -- admission (docs/contract.md §3 steps 4 to 6, §4) --------------------------------------

    async def admit(self, call: Call) -> Admitted | Replayed | Refused:
        return await self._write(lambda conn: self._admit(conn, call), of_call=True)

    def _admit(self, conn: sqlite3.Connection, call: Call) -> Admitted | Replayed | Refused:
        """One read (`sqlite_admit`), then the writes: for a new call the fence (only when it
        advances) and the receipt, which holds the key (schema 8)."""
        now = self._now()
        key, fingerprint = call.idempotency_key, call.fingerprint
        known = sqlite_admit.read(conn, call.resource, key, call.issuer == "gateway", now)
        row = known.row
        current = known.lease
        code, owner = fences.check(
            call.issuer,
            call.fence,
            row.issued,
            floors.accepted(known.floors, call.resource, row),
            current.view(now) if current else None,
            call.owner,
            call.client,
            call.clients_configured,
            floors.bound(known.floors, call.resource, call.issuer, row),
        )
        if code is not None:
            return Refused(code, self._insert_rejection(conn, call.rejection(owner, code), now))

        if call.fence > row.accepted:  # else the row holds it already: nothing to write
            conn.execute(
                "INSERT INTO fences (resource, accepted) VALUES (?, ?) ON CONFLICT (resource) "
                "DO UPDATE SET accepted = max(accepted, excluded.accepted)",
                (call.resource, call.fence),
            )
        if key is None or fingerprint is None:  # a session: no step 5 (docs/contract.md §15)
            receipt_id = self._insert_admitted(conn, call, owner, None, now)
            return Admitted(receipt_id, None, owner, self.instance)

        decision = idempotency.decide(known.latest, fingerprint, call.retry_statuses, known.pruned)
        if isinstance(decision, idempotency.Replay):
            stored = conn.execute(
                "SELECT http_status, response_headers, response_body FROM receipts WHERE id = ?",
                (decision.receipt_id,),
            ).fetchone()
            return replayed_of(decision.receipt_id, stored)
        if isinstance(decision, idempotency.Refuse):
            rejection = call.rejection(owner, decision.code)
            receipt_id = self._insert_rejection(conn, rejection, now, key, fingerprint)
            return Refused(decision.code, receipt_id, decision.receipt_id)

        receipt_id = self._insert_admitted(conn, call, owner, decision.attempt, now)
        return Admitted(receipt_id, decision.attempt, owner, self.instance)

    def _insert_admitted(
        self,
        conn: sqlite3.Connection,
        call: Call,
        owner: str | None,
        attempt: int | None,
        now: float,
    ) -> str:
        """The `pending` receipt of an admitted call or session; a call's is its key's latest
        receipt from now on, and keeps the key (`key_retention_s`)."""
        receipt_id = self._new_id(now)
        conn.execute(
            "INSERT INTO receipts (id, resource, fence, owner, client, upstream, method, path, "
            "idempotency_key, fingerprint, attempt, status, created_at, forwarded_at, instance, "
            "kind, mcp, trace_id, key_retention_s) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?)",
            (
                receipt_id,
                call.resource,
                call.fence,
                owner,
                call.client,
                call.upstream,
                call.method,
                call.path,
                call.idempotency_key,
                call.fingerprint,
                attempt,
                now,
                now,
                self.instance,
                call.kind,
                mcp_json(call.mcp),
                call.trace_id,
                None if call.idempotency_key is None else call.retention_s,
            ),
        )
        return receipt_id

    @staticmethod
    def _lease(conn: sqlite3.Connection, resource: str) -> Lease | None:
        row = conn.execute("SELECT * FROM leases WHERE resource = ?", (resource,)).fetchone()
        return lease_of(row) if row else None

    @staticmethod
    def _key_state(
        conn: sqlite3.Connection, resource: str, key: str, now: float
    ) -> idempotency.KeyState | None:
        row = conn.execute(_KEY_STATE, (resource, key, now)).fetchone()
        return key_state(row) if row else None

    def _insert_rejection(
        self,
        conn: sqlite3.Connection,
        rejection: Rejection,
        now: float,
        key: str | None = None,
        fingerprint: str | None = None,
    ) -> str:
        receipt_id = self._new_id(now)
        conn.execute(
            f"INSERT INTO receipts ({REJECTED_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, "
            "?9, ?10, 'rejected', ?11, ?12, ?13, ?13, ?14, ?15, ?16, ?17)",
            rejected_values(receipt_id, rejection, key, fingerprint, now, self.instance),
        )
        return receipt_id

    async def reject(self, rejection: Rejection) -> str:
        return await self._write(
            lambda conn: self._insert_rejection(conn, rejection, self._now()), of_call=True
        )

    # -- outcomes (§3, "Outcome") -------------------------------------------------------------

    async def complete(self, receipt_id: str, outcome: Outcome) -> Completion:
        return await self._write(
            lambda conn: self._complete(conn, receipt_id, outcome), of_call=True
        )

    def _complete(self, conn: sqlite3.Connection, receipt_id: str, outcome: Outcome) -> Completion:
        """A `pending` receipt (nearly every call's) takes its outcome, and its key's retention,
        in one statement; any other receipt is read first and decided."""
        now = self._now()
        completion = outcomes.decide_completion("pending", outcome.status)
        if conn.execute(
            f"{_RECORD_OUTCOME} AND status = 'pending'",
            self._outcome_values(outcome, now, completion, receipt_id),
        ).rowcount:
            return completion
        row = conn.execute("SELECT status FROM receipts WHERE id = ?", (receipt_id,)).fetchone()
        completion = outcomes.decide_completion(row["status"] if row else None, outcome.status)
        if completion is Completion.LATE_OUTCOME:
            # The resolution stands; the tool's own answer is kept beside it for the alert.
            conn.execute(
                "UPDATE receipts SET error = 'late_outcome', late = 1, http_status = ? "
                "WHERE id = ?",
                (outcome.http_status, receipt_id),
            )
        elif completion in (Completion.RECORDED, Completion.LATE):
            conn.execute(
                _RECORD_OUTCOME, self._outcome_values(outcome, now, completion, receipt_id)
            )
        return completion

    @staticmethod
    def _outcome_values(
        outcome: Outcome, now: float, completion: Completion, receipt_id: str
    ) -> tuple[object, ...]:
        """`_RECORD_OUTCOME`'s parameters for an outcome that does `completion`."""
        return (
            outcome.status,
            outcome.http_status,
            outcome.error,
            int(completion is Completion.LATE),
            outcome.forwarded_at,
            now,
            int(outcome.replayable),
            *outcome_columns(outcome),
            receipt_id,
            outcomes.settles_key(completion, outcome.status),
        )

    async def mark_forwarded(self, receipt_id: str) -> bool:
        """The call leaves now, later than its admission (it waited for older calls): the
        time a reconciler must wait counts from here, so this is durable before it leaves."""
        updated: int = await self._write(
            lambda conn: (
                conn.execute(
                    "UPDATE receipts SET forwarded_at = ? WHERE id = ? AND status = 'pending'",
                    (self._now(), receipt_id),
                ).rowcount
            ),
            of_call=True,
        )
        return updated == 1

    async def session_opened(self, receipt_id: str, record: SessionRecord) -> None:
        await self._write(
            lambda conn: conn.execute(
                "UPDATE receipts SET http_status = 101, session = ? "
                "WHERE id = ? AND status = 'pending'",
                (session_json(record), receipt_id),
            )
        )

    async def fence_states(self, resources: list[str]) -> dict[str, FenceState]:
        def op(conn: sqlite3.Connection) -> dict[str, FenceState]:
            now = self._now()
            states: dict[str, FenceState] = {}
            for start in range(0, len(resources), _IN_LIST_MAX):
                chunk = resources[start : start + _IN_LIST_MAX]
                rows = conn.execute(
                    "SELECT f.resource, f.accepted, l.fence, l.state, l.expires_at "
                    "FROM fences f LEFT JOIN leases l ON l.resource = f.resource "
                    f"WHERE f.resource IN ({', '.join('?' * len(chunk))})",
                    chunk,
                ).fetchall()
                for row in rows:
                    states[row["resource"]] = FenceState(
                        accepted=row["accepted"],
                        lease_fence=row["fence"],
                        lease_live=row["state"] == "held" and now < row["expires_at"],
                    )
            return states

        return await self._read(op)

    async def mark_incomplete(self, receipt_id: str) -> None:
        await self._write(
            lambda conn: conn.execute(
                "UPDATE receipts SET error = 'response_incomplete', replayable = 0, "
                "response_headers = NULL, response_body = NULL "
                "WHERE id = ? AND status <> 'reconciled'",
                (receipt_id,),
            )
        )

    async def resolve(
        self,
        receipt_id: str,
        outcome: Resolution,
        source: str,
        note: str | None,
        waits: ReconcileWaits,
    ) -> Receipt | ResolveRefused:
        def op(conn: sqlite3.Connection) -> Receipt | ResolveRefused:
            now = self._now()
            row = conn.execute(
                "SELECT status, upstream, forwarded_at, created_at FROM receipts WHERE id = ?",
                (receipt_id,),
            ).fetchone()
            if row is None:
                return ResolveRefused.NOT_FOUND
            ready_at = waits.ready_at(row["upstream"], row["forwarded_at"], row["created_at"])
            if not may_resolve(row["status"], ready_at, now):
                return ResolveRefused.NOT_RECONCILABLE
            [updated] = conn.execute(  # settled: its key's retention starts now
                "UPDATE receipts SET status = 'reconciled', resolution = ?1, "
                "completed_at = coalesce(completed_at, ?2), key_expires_at = ?2 + key_retention_s "
                f"WHERE id = ?3 RETURNING {RECEIPT_SELECT}",
                (resolution_json(outcome, source, note, now), now, receipt_id),
            ).fetchall()
            return receipt_of(updated)

        return await self._write(op)

    # -- reads (§7) ---------------------------------------------------------------------------

    async def get_receipt(self, receipt_id: str) -> Receipt | None:
        def op(conn: sqlite3.Connection) -> Receipt | None:
            row = conn.execute(
                f"SELECT {RECEIPT_SELECT} FROM receipts WHERE id = ?", (receipt_id,)
            ).fetchone()
            return receipt_of(row) if row else None

        return await self._read(op)

    async def list_receipts(self, query: ReceiptQuery) -> ReceiptPage:
        """Ordered by id, which is the order in which the writer's commits made them."""
        conditions, params = receipt_conditions(query, lambda _: "?")
        if query.after is not None:
            conditions.append("id > ?")
            params.append(query.after)
        sql = f"SELECT {RECEIPT_SELECT} FROM receipts {where(conditions)} ORDER BY id LIMIT ?"

        def op(conn: sqlite3.Connection) -> ReceiptPage:
            items = [receipt_of(row) for row in conn.execute(sql, (*params, query.limit))]
            return ReceiptPage(items, items[-1].id if items else None)

        return await self._read(op)

    # -- leases (§6) --------------------------------------------------------------------------

    async def acquire(
        self,
        resource: str,
        owner: str,
        ttl_s: float,
        lock_delay_s: float,
        client: str | None,
        acquire_key: str | None,
    ) -> AcquireResult:
        """The acquire CAS; always durable, also in relaxed mode."""
        return await self._write(
            lambda conn: self._acquire(
                conn, resource, owner, ttl_s, lock_delay_s, client, acquire_key
            ),
            durable=True,
        )

    def _acquire(
        self,
        conn: sqlite3.Connection,
        resource: str,
        owner: str,
        ttl_s: float,
        lock_delay_s: float,
        client: str | None,
        acquire_key: str | None,
    ) -> AcquireResult:
        """The acquire CAS inside a transaction (the sweeper's claim uses it too)."""
        now = self._now()
        current = self._lease(conn, resource)
        decision = leases.decide_acquire(current, owner, client, acquire_key, lock_delay_s, now)
        if current is not None and isinstance(decision, leases.Retried):
            return AcquireResult("retried", shown(current, now), None)
        if current is not None and isinstance(decision, leases.Held):
            return AcquireResult("held", shown(current, now), None)
        fence = floors.next_fence(
            sqlite_floors.read_floors(conn), resource, sqlite_floors.fence_row(conn, resource)
        )
        conn.execute(
            "INSERT INTO fences (resource, issued) VALUES (?, ?) "
            "ON CONFLICT (resource) DO UPDATE SET issued = excluded.issued",
            (resource, fence),
        )
        conn.execute(
            "INSERT OR REPLACE INTO leases (resource, owner, fence, client, acquire_key, "
            "state, acquired_at, renewed_at, expires_at, ended_at) "
            "VALUES (?, ?, ?, ?, ?, 'held', ?, ?, ?, NULL)",
            (resource, owner, fence, client, acquire_key, now, now, now + ttl_s),
        )
        granted = Lease(
            resource=resource,
            owner=owner,
            fence=fence,
            state="held",
            client=client,
            acquire_key=acquire_key,
            acquired_at=now,
            renewed_at=now,
            expires_at=now + ttl_s,
        )
        held = decision.held_seconds if isinstance(decision, leases.Grant) else None
        return AcquireResult("acquired", granted, held)

    async def renew(
        self, resource: str, owner: str, fence: int, ttl_s: float, client: str | None = None
    ) -> Lease | None:
        """The renewed lease, or None when it is lost (not ours, expired or released)."""

        def op(conn: sqlite3.Connection) -> Lease | None:
            now = self._now()
            current = self._lease(conn, resource)
            if current is None or not leases.may_renew(current, owner, fence, client, now):
                return None
            conn.execute(
                "UPDATE leases SET renewed_at = ?, expires_at = ? WHERE resource = ?",
                (now, now + ttl_s, resource),
            )
            return replace(current, renewed_at=now, expires_at=now + ttl_s)

        return await self._write(op)

    async def release(
        self, resource: str, owner: str | None, fence: int | None, client: str | None = None
    ) -> Release:
        """With owner and fence None: an admin's revoke (`gateway.core.leases`)."""

        def op(conn: sqlite3.Connection) -> Release:
            now = self._now()
            decision = leases.decide_release(self._lease(conn, resource), owner, fence, client, now)
            if decision.action == "release":
                conn.execute(
                    "UPDATE leases SET state = 'released', ended_at = ? WHERE resource = ?",
                    (now, resource),
                )
            elif decision.action == "free":
                conn.execute("UPDATE leases SET state = 'released' WHERE resource = ?", (resource,))
            return decision

        return await self._write(op)

    async def get_lease(self, resource: str) -> Lease | None:
        def op(conn: sqlite3.Connection) -> Lease | None:
            current = self._lease(conn, resource)
            return shown(current, self._now()) if current else None

        return await self._read(op)

    async def list_leases(
        self, prefix: str | None, state: str | None, after: str | None, limit: int
    ) -> list[Lease]:
        def op(conn: sqlite3.Connection) -> list[Lease]:
            now = self._now()
            clauses: list[str] = []
            params: list[object] = []
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
            rows = conn.execute(
                f"SELECT * FROM leases {where} ORDER BY resource LIMIT ?", [*params, limit]
            ).fetchall()
            return [shown(lease_of(r), now) for r in rows]

        return await self._read(op)

    async def expire_leases(self, cleanup_delay: CleanupDelay | None = None) -> list[Lease]:
        def op(conn: sqlite3.Connection) -> list[Lease]:
            now = self._now()
            expired = [
                lease_of(row)
                for row in conn.execute(
                    "SELECT * FROM leases WHERE state = 'held' AND expires_at <= ?", (now,)
                ).fetchall()
            ]
            conn.execute(
                "UPDATE leases SET state = 'expired', ended_at = ? "
                "WHERE state = 'held' AND expires_at <= ?",
                (now, now),
            )
            if cleanup_delay is not None:
                self._schedule_cleanups(conn, expired, cleanup_delay, now)
            return expired

        return await self._write(op)

    # -- sweeper cleanups (§9; the decisions are gateway.core.cleanups') -------------------

    @staticmethod
    def _schedule_cleanups(
        conn: sqlite3.Connection, expired: list[Lease], cleanup_delay: CleanupDelay, now: float
    ) -> None:
        # A newer expiry replaces an older owed cleanup: whoever held the resource in
        # between superseded it, and the newest lease is the one to clean up after.
        conn.executemany(
            "INSERT INTO cleanups (resource, lease_fence, lease_owner, due_at, attempts, "
            "sweep_fence, last_error, created_at) VALUES (?, ?, ?, ?, 0, NULL, NULL, ?) "
            "ON CONFLICT (resource) DO UPDATE SET lease_fence = excluded.lease_fence, "
            "lease_owner = excluded.lease_owner, due_at = excluded.due_at, attempts = 0, "
            "sweep_fence = NULL, last_error = NULL, created_at = excluded.created_at",
            owed_cleanup_rows(expired, cleanup_delay, now),
        )

    async def due_cleanups(self, limit: int) -> list[str]:
        """Resources whose owed cleanup is due now, the longest due first."""
        return await self._read(
            lambda conn: [
                row["resource"]
                for row in conn.execute(
                    "SELECT resource FROM cleanups WHERE due_at <= ? ORDER BY due_at LIMIT ?",
                    (self._now(), limit),
                ).fetchall()
            ]
        )

    async def list_cleanups(self) -> list[OwedCleanup]:
        """Every owed cleanup, for operators and tests."""
        return await self._read(
            lambda conn: [
                owed_cleanup_of(row)
                for row in conn.execute("SELECT * FROM cleanups ORDER BY resource").fetchall()
            ]
        )

    async def claim_cleanup(
        self, resource: str, owner: str, ttl_s: float, lock_delay_s: float, recheck_s: float
    ) -> CleanupClaim:
        """Decide the next step of an owed cleanup and, when it is to be tried, acquire the
        resource as `owner` (a new fence). Durable like every acquire.

        `recheck_s`: how long to leave the row alone when it must wait (an earlier attempt's
        outcome is unknown, or the resource is still held).
        """
        return await self._write(
            lambda conn: self._claim_cleanup(conn, resource, owner, ttl_s, lock_delay_s, recheck_s),
            durable=True,
        )

    def _claim_cleanup(
        self,
        conn: sqlite3.Connection,
        resource: str,
        owner: str,
        ttl_s: float,
        lock_delay_s: float,
        recheck_s: float,
    ) -> CleanupClaim:
        now = self._now()
        row = conn.execute("SELECT * FROM cleanups WHERE resource = ?", (resource,)).fetchone()
        if row is None:
            return CleanupClaim("not_due")
        owed = owed_cleanup_of(row)
        earlier = (
            None
            if owed.sweep_fence is None
            else self._key_state(conn, resource, idempotency.sweep_key(owed.sweep_fence), now)
        )
        current = self._lease(conn, resource)
        verdict = cleanups.decide_claim(
            owed,
            earlier,
            current.fence if current else None,
            current.owner if current else None,
            now,
        )
        if verdict is None:  # still owed, after the lease it follows: try the acquire CAS
            taken = self._acquire(conn, resource, owner, ttl_s, lock_delay_s, None, None)
            if taken.result == "acquired":
                fence = taken.lease.fence
                conn.execute(
                    "UPDATE cleanups SET sweep_fence = ?, attempts = attempts + 1 "
                    "WHERE resource = ?",
                    (fence, resource),
                )
                return cleanups.claimed(owed, fence)
            verdict = CleanupClaim("busy", holder=taken.lease.owner)
        if cleanups.row_action(verdict) == "recheck":
            conn.execute(
                "UPDATE cleanups SET due_at = ? WHERE resource = ?", (now + recheck_s, resource)
            )
        elif cleanups.row_action(verdict) == "forget":
            conn.execute("DELETE FROM cleanups WHERE resource = ?", (resource,))
        return verdict

    async def finish_cleanup(
        self,
        resource: str,
        fence: int,
        done: bool,
        retry_at: float | None = None,
        error: str | None = None,
    ) -> None:
        """After attempt `fence`: forget the cleanup when `done`, else note why and when to
        look again. A row a newer expiry replaced meanwhile is left alone."""

        def op(conn: sqlite3.Connection) -> None:
            if done:
                conn.execute(
                    "DELETE FROM cleanups WHERE resource = ? AND sweep_fence = ?", (resource, fence)
                )
            else:
                conn.execute(
                    "UPDATE cleanups SET due_at = ?, last_error = ? "
                    "WHERE resource = ? AND sweep_fence = ?",
                    (retry_at if retry_at is not None else self._now(), error, resource, fence),
                )

        await self._write(op)

    async def drop_cleanup(self, resource: str) -> None:
        """Forget an owed cleanup (its rule no longer has `on_expiry`)."""
        await self._write(
            lambda conn: conn.execute("DELETE FROM cleanups WHERE resource = ?", (resource,))
        )

    # -- checkpoints and the run view (§17) ----------------------------------------------------

    async def write_checkpoint(
        self, new: NewCheckpoint, issuer: Issuer, clients_configured: bool
    ) -> CheckpointWritten | CheckpointRefused:
        """Durable before it answers, in relaxed mode too: a checkpoint is what a
        replacement worker resumes from."""
        return await self._write(
            lambda conn: self._write_checkpoint(conn, new, issuer, clients_configured),
            durable=True,
        )

    def _write_checkpoint(
        self, conn: sqlite3.Connection, new: NewCheckpoint, issuer: Issuer, clients: bool
    ) -> CheckpointWritten | CheckpointRefused:
        now = self._now()
        fence_row = sqlite_floors.fence_row(conn, new.resource)
        known = sqlite_floors.read_floors(conn)
        current = self._lease(conn, new.resource) if issuer == "gateway" else None
        row = conn.execute(cp.latest_checkpoint(_q), (new.resource,)).fetchone()
        latest = cp.checkpoint_of(row) if row else None
        decision = checkpoints.decide_write(
            issuer, new, fence_row, known, current.view(now) if current else None, latest, clients
        )
        if isinstance(decision, checkpoints.Refuse):
            return CheckpointRefused(decision.code)
        if isinstance(decision, checkpoints.Retry):
            return CheckpointWritten(decision.latest, created=False)
        # the mark in the writer thread, as every receipt id
        written = decision.checkpoint(new, now, mark=self._new_id(now))
        if latest is not None:
            conn.execute(cp.retire_checkpoint(_q), (latest.resource, latest.seq))
        conn.execute(cp.insert_checkpoint(_q), (*_checkpoint_values(written), new.retention_s))
        return CheckpointWritten(written, created=True)

    async def list_checkpoints(
        self, resource: str, before_seq: int | None, limit: int
    ) -> list[Checkpoint]:
        sql = cp.list_checkpoints(_q, before_seq is not None)
        args = (resource, before_seq, limit) if before_seq is not None else (resource, limit)
        return await self._read(
            lambda conn: [cp.checkpoint_of(r) for r in conn.execute(sql, args).fetchall()]
        )

    async def run_records(self, resource: str) -> RunRecords:
        def op(conn: sqlite3.Connection) -> RunRecords:
            conn.execute("BEGIN")  # one snapshot for every read below
            try:
                return self._run_records(conn, resource)
            finally:
                conn.execute("COMMIT")

        return await self._read(op)

    def _run_records(self, conn: sqlite3.Connection, resource: str) -> RunRecords:
        now = self._now()
        fence_row = sqlite_floors.fence_row(conn, resource)
        accepted = floors.accepted(sqlite_floors.read_floors(conn), resource, fence_row)
        lease = self._lease(conn, resource)
        row = conn.execute(cp.latest_checkpoint(_q), (resource,)).fetchone()
        checkpoint = cp.checkpoint_of(row) if row else None
        bounds = (resource, *cp.since(checkpoint))

        def newest(group: checkpoints.Group) -> list[Receipt]:
            rows = conn.execute(cp.group_receipts(_q, group), bounds).fetchall()
            return [receipt_of(r) for r in reversed(rows)]

        rejected, unknown = cp.rejected_and_unknown(conn.execute(cp.tallies(_q), bounds))
        return RunRecords(
            lease=shown(lease, now) if lease else None,
            highest_fence=max(fence_row.issued, accepted),
            checkpoint=checkpoint,
            completed=newest("completed"),
            needs_confirmation=newest("needs_confirmation"),
            rejected=rejected,
            unknown_since=unknown,
            now=now,
        )

    async def prune_checkpoints(self) -> int:
        sql = cp.prune_checkpoints(_q, "?")
        return await self._write(
            lambda conn: conn.execute(sql, (self._now(), PRUNE_BATCH)).rowcount, bulk=True
        )

    # -- upkeep (§9) --------------------------------------------------------------------------

    async def pending_ahead(self, resource: str, fence: int, turn: int | None) -> bool:
        return False  # one process per database: its lanes see every call in flight

    def may_forward(self, instance: str) -> bool:
        return True  # no peer ever recovers this process's receipts while it runs

    async def heartbeat(self) -> None:
        await self._write(
            lambda conn: conn.execute(
                "UPDATE instances SET heartbeat_at = ? WHERE id = ?", (self._now(), self.instance)
            )
        )

    async def expire_pending(
        self, waits: ReconcileWaits, silent_after_s: float, in_flight: frozenset[str]
    ) -> dict[str, int]:
        """Turn lost `pending` receipts `outcome_unknown` (`gateway.core.receipts.is_lost`);
        how many, by upstream."""

        def op(conn: sqlite3.Connection) -> dict[str, int]:
            now = self._now()
            rows = conn.execute(
                "SELECT r.id, r.upstream, r.created_at, r.forwarded_at, r.kind, r.instance, "
                "i.heartbeat_at "
                "FROM receipts r LEFT JOIN instances i ON i.id = r.instance "
                "WHERE r.status = 'pending'"
            ).fetchall()
            lost = lost_receipts(rows, waits, silent_after_s, in_flight, now, self.instance)
            conn.executemany(
                "UPDATE receipts SET status = 'outcome_unknown', error = "
                "'outcome_not_recorded' WHERE id = ? AND status = 'pending'",
                [(row["id"],) for row in lost],
            )
            return count_by_upstream(lost)

        return await self._write(op, bulk=True)

    async def prune(self, receipt_retention_s: float) -> int:
        """Receipts past their retention, PRUNE_BATCH rows per write; how many went.

        A key needs no pruning: it expires where it is looked up (`sqlite_admit.KEY_RECEIPT`).
        A receipt that still keeps its key is kept, unless a later one of the key has taken
        the key over (found by receipts_by_key). Each status's receipts are found by
        receipts_by_status, up to the cutoff's millisecond: a receipt completed before the
        cutoff was created before it, and its id is of the time it was created (one whose id
        ran ahead of a clock set back goes once the cutoff passes its id's time)."""

        def receipts(conn: sqlite3.Connection) -> int:
            now = self._now()
            cutoff = now - receipt_retention_s
            return conn.execute(
                f"DELETE FROM receipts WHERE id IN (SELECT r.id FROM receipts r WHERE r.status "
                f"IN ({SETTLED_SQL}) AND r.id < ?1 AND r.completed_at < ?2 AND "
                "(r.key_retention_s IS NULL OR r.key_expires_at <= ?3 OR EXISTS (SELECT 1 "
                "FROM receipts p WHERE p.idempotency_key = r.idempotency_key "
                "AND p.resource = r.resource AND p.id > r.id AND p.status != 'rejected')) "
                "LIMIT ?4)",
                (id_ceiling(cutoff), cutoff, now, PRUNE_BATCH),
            ).rowcount

        return await self._in_batches(receipts)

    async def _in_batches(self, op: Callable[[sqlite3.Connection], int]) -> int:
        """Run the deleting `op` until it deletes less than a batch (or PRUNE_BATCHES times)."""
        total = 0
        for _ in range(PRUNE_BATCHES):
            deleted = await self._write(op, bulk=True)
            total += deleted
            if deleted < PRUNE_BATCH:
                break
        return total

    async def oldest_unknown_age(self) -> float:
        def op(conn: sqlite3.Connection) -> float:
            row = conn.execute(
                "SELECT min(created_at) AS t FROM receipts WHERE status = 'outcome_unknown'"
            ).fetchone()
            return self._now() - row["t"] if row["t"] is not None else 0.0

        return await self._read(op)

    # -- fence floors (§18; the decisions are gateway.core.floors') ------------------------

    async def raise_fence(self, resource: str, at_least: int) -> int:
        return await self._write(
            lambda conn: sqlite_floors.raise_one(conn, resource, at_least), durable=True
        )

    async def raise_fences(self, match: str, at_least: int) -> int:
        return await self._write(
            lambda conn: sqlite_floors.raise_glob(conn, match, at_least, self._now()),
            durable=True,
            bulk=True,
        )

    async def apply_restore(self, gap: int, beyond: int = 0) -> RestoreReport:
        return await self._write(
            lambda conn: sqlite_floors.apply_restore(conn, gap, beyond, self._now()),
            durable=True,
            bulk=True,
        )

    async def highest_fence(self) -> int:
        return await self._read(sqlite_floors.highest_fence)

    async def known_resources(self) -> list[str]:
        return await self._read(sqlite_floors.known_resources)

    # One file, one server: no failover, no store epochs (docs/contract.md §19).
    replication_problem: str | None = None

    def drain_epoch_changes(self) -> list[EpochChange]:
        return []

    async def latest_epoch_change(self) -> EpochChange | None:
        return None

    async def fence_floors(self) -> floors.Floors:
        return await self._read(sqlite_floors.read_floors)
