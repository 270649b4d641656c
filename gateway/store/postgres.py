"""The shared store: PostgreSQL through asyncpg, for any number of replicas (docs/contract.md §14).

Each atomic step is one PostgreSQL transaction whose checks the database makes. A step that
decides about a resource first locks that resource's `fences` row (an upsert that returns the
row, so one statement locks, reads the fences and takes the database's time); then, in a new
statement (READ COMMITTED: a fresh snapshot, taken after the lock), it reads the lease and key
rows, asks the plain functions of `gateway.core`, and writes what they decide. Every writer of
a resource's fences, lease, keys and owed cleanup holds that row lock, so under it the
read-decide-write is atomic across replicas. An admission under an external issuer's token
with a key nothing holds yet is all of that in one statement: a plpgsql function
(`admit_fresh`) that takes the same lock first, whose later statements each take a fresh
snapshot too, and that admits only in a state where the plain functions are known to admit
(writing nothing anywhere else, where the full transaction decides). Steps about one receipt
lock the receipt's row (`FOR UPDATE`) or are one conditional statement. Times that decide
expiry are the database's (`clock_timestamp()`), kept as epoch seconds like on SQLite, so
rows convert alike (`gateway.store.rows`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from importlib import resources
from typing import Any, TypeVar

import asyncpg

from gateway.core import (
    checkpoints,
    cleanups,
    fences,
    floors,
    idempotency,
    leases,
    liveness,
    outcomes,
)
from gateway.core.epochs import Mode
from gateway.core.errors import StoreUnavailable
from gateway.core.fences import Issuer
from gateway.core.floors import DEFAULT_GAP
from gateway.core.receipts import ReconcileWaits, Resolution, may_resolve
from gateway.store import checkpoint_rows as cp
from gateway.store import pg_epochs, pg_sync, postgres_floors, postgres_lists
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
from gateway.store.floor_rows import fence_row_of
from gateway.store.ids import MonotonicUlid
from gateway.store.pg_hosts import NoWritableHost
from gateway.store.pg_outcomes import OutcomeBatches, Row
from gateway.store.pg_primary import START_TIMEOUT_S, PostgresStartupError, PrimaryLink
from gateway.store.rows import (
    KEY_STATE_COLUMNS,
    KEY_STATE_SELECT,
    LEASE_COLUMNS,
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
    receipt_of,
    rejected_values,
    replayed_of,
    resolution_json,
    session_json,
)

T = TypeVar("T")

SCHEMA_VERSION = 12
"""The newest schema this code knows; `_MIGRATIONS[n]` takes a database from n - 1 to n."""
_MIGRATIONS = {n: f"schema/postgres-{n}.sql" for n in range(1, SCHEMA_VERSION + 1)}
_MIGRATION_LOCK = 0x66656E6365  # pg_advisory_xact_lock key: "fence"
POOL_MIN, POOL_MAX = 1, 10
# A database that stops answering must not hold a call (or the heartbeat) forever: the call
# fails closed with `store_unavailable` instead.
CONNECT_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 30.0
PRUNE_BATCH = 1000
_RETRIES = 3  # a deadlock or serialization failure is retried this many times in all
_DURABLE_SETTINGS = ("on", "remote_write", "remote_apply")
# The server's settings `open` looks at, in one round trip
_SETTINGS = "SELECT current_setting('synchronous_commit'), current_setting('autovacuum')"
# Receipts and keys are written, updated and pruned all day: each call leaves dead row versions
# behind in their tables and indexes, which only VACUUM takes away. Without autovacuum they
# pile up without bound, and every admission's index look-ups walk over them (measured after
# a few minutes of load: 9,000 dead receipts, and a vacuum gave back a sixth of the calls/s).
_NO_AUTOVACUUM = (
    "this PostgreSQL server runs with autovacuum off: the receipts' and keys' tables will "
    "bloat and admissions slow down unless they are vacuumed on a schedule"
)

_NOW = "extract(epoch from clock_timestamp())::float8"

# Lock a resource's fences row (creating it), and read it, the store-wide fence floors
# (docs/contract.md §18), the database's time after the lock and the replication settings
# the transaction runs under (§19).
_LOCK_FENCES = (
    "INSERT INTO fences (resource) VALUES ($1) ON CONFLICT (resource) "
    f"DO UPDATE SET issued = fences.issued RETURNING issued, accepted, {_NOW} AS now, "
    + postgres_floors.FLOORS_RETURNING
    + f", {pg_sync.SETTINGS}"
)
# The same for a resource that may have no row: no lease without one (acquire writes it).
_LOCK_FENCES_IF_ANY = f"SELECT {_NOW} AS now FROM fences WHERE resource = $1 FOR UPDATE"

# Lock a resource's fences row only if it exists, and read it: a refused checkpoint writes
# nothing, not even an empty fences row.
_LOCK_FENCES_ROW = (
    f"SELECT issued, accepted, {_NOW} AS now, "
    + postgres_floors.FLOORS_RETURNING
    + " FROM fences WHERE resource = $1 FOR UPDATE"
)

# The run view's head in one read: the database's time, the fences, the lease and the latest
# checkpoint of a resource.
_RUN_HEAD = (
    f"SELECT {_NOW} AS now, f.issued, f.accepted, "
    + ", ".join(
        [f"l.{c} AS l_{c}" for c in LEASE_COLUMNS]
        + [f"c.{c} AS c_{c}" for c in cp.CHECKPOINT_COLUMNS]
    )
    + " FROM (VALUES (1)) AS one (x) LEFT JOIN fences f ON f.resource = $1 "
    "LEFT JOIN leases l ON l.resource = $1 "
    "LEFT JOIN LATERAL (SELECT * FROM checkpoints WHERE resource = $1 "
    "ORDER BY seq DESC LIMIT 1) c ON true"
)

_LEASE_BY_RESOURCE = "SELECT * FROM leases WHERE resource = $1"

# After the lock: the lease, the key's latest receipt and, without one, the earlier attempts.
# A key's receipt is joined by its id alone (ids are unique, and a key's receipt is of its
# resource): joined by resource and id, a plan made while `receipts` was empty (a connection
# plans a statement on first use) read every receipt of the resource and kept the one id.
_LEASE_AND_KEY = ", ".join(
    [f"l.{c} AS l_{c}" for c in LEASE_COLUMNS] + [f"r.{c} AS k_{c}" for c in KEY_STATE_COLUMNS]
)
# A key row is the key until it expires, swept or not (docs/contract.md §4): the row of one
# expired is only deleted by retention's next sweep.
_KEY_KEPT = "(k.expires_at IS NULL OR k.expires_at > {now})"
_ADMIT_READ = (
    f"SELECT {_LEASE_AND_KEY}, "
    "CASE WHEN r.id IS NULL THEN (SELECT count(*) FROM receipts p WHERE p.resource = $1 "
    "AND p.idempotency_key = $2 AND p.status <> 'rejected') END AS pruned "
    "FROM (VALUES (1)) AS one (x) "
    "LEFT JOIN leases l ON l.resource = $1 "
    "LEFT JOIN idempotency_keys k ON k.resource = $1 AND k.key = $2 AND "
    f"{_KEY_KEPT.format(now='$3')} "
    "LEFT JOIN receipts r ON r.id = k.receipt_id"
)

_KEY_STATE = (
    f"SELECT {KEY_STATE_SELECT} FROM idempotency_keys k JOIN receipts r "
    f"ON r.id = k.receipt_id WHERE k.resource = $1 AND k.key = $2 AND {_KEY_KEPT.format(now=_NOW)}"
)

_ADVANCE = "UPDATE fences SET accepted = greatest(accepted, {fence}) WHERE resource = {resource}"

_INSERT_REJECTED = (
    f"INSERT INTO receipts ({REJECTED_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, "
    f"'rejected', $11, $12, coalesce($13::float8, {_NOW}), coalesce($13::float8, {_NOW}), $14, "
    "$15, $16, $17)"
)
# A refusal at the idempotency step still advances the fence (docs/contract.md §3, step 6).
_ADVANCE_AND_REJECT = (
    f"WITH f AS ({_ADVANCE.format(fence='$3', resource='$2')}) " + _INSERT_REJECTED
)
_ADVANCE_AND_REPLAY = (
    f"WITH f AS ({_ADVANCE.format(fence='$2', resource='$1')}) "
    "SELECT http_status, response_headers, response_body FROM receipts "
    "WHERE resource = $1 AND id = $3"
)
# The admission itself: the fence advanced (and, for a serial call, the resource's next turn
# taken), the key claimed, the `pending` receipt written. It answers whether calls of the
# resource that must go first are still pending, on any replica (the CTEs' writes are not
# visible to the EXISTS: it sees the receipts admitted before this one). $15: 1 when serial.
_ADMIT = (
    "WITH f AS (UPDATE fences SET accepted = greatest(accepted, $3), turns = turns + $15 "
    "WHERE resource = $1 RETURNING CASE WHEN $15 = 1 THEN turns END AS turn), "
    "k AS (INSERT INTO idempotency_keys (resource, key, receipt_id, retention_s, expires_at) "
    "VALUES ($1, $9, $2, $14, NULL) ON CONFLICT (resource, key) DO UPDATE SET "
    "receipt_id = excluded.receipt_id, retention_s = excluded.retention_s, expires_at = NULL), "
    "r AS (INSERT INTO receipts (id, resource, fence, owner, client, upstream, method, path, "
    "idempotency_key, fingerprint, attempt, status, created_at, forwarded_at, instance, turn, "
    "mcp, trace_id) SELECT $2, $1, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'pending', $12, $12, "
    "$13, f.turn, $16, $17 "
    "FROM f) "
    "SELECT f.turn, EXISTS (SELECT 1 FROM receipts o WHERE o.resource = $1 "
    "AND o.status = 'pending' AND o.fence < $3) OR (f.turn IS NOT NULL AND EXISTS ("
    "SELECT 1 FROM receipts o WHERE o.resource = $1 AND o.status = 'pending' "
    "AND o.turn < f.turn)) AS ahead FROM f"
)
# The same admission in one statement, for the state `admit_fresh` (schema version 9) is sure
# of: a row when it admitted, none when it wrote nothing. $1 to $10 as `_ADMIT`'s, then the
# attempt, the instance, the key's retention, 1 when serial, the MCP record, the trace.
_ADMIT_FRESH = (
    "SELECT taken_turn, ahead FROM admit_fresh($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, "
    "$12, $13, $14, $15, $16)"
)
# What `admit_fresh` raises to undo the fences row it made for a resource it did not admit.
_FRESH_DECLINED = "FG001"
# A session's admission (docs/contract.md §15): the fence advanced and the `pending` receipt
# written, no key, no serial turn (an open session must not hold the resource's turns).
_ADMIT_SESSION = (
    "WITH f AS (UPDATE fences SET accepted = greatest(accepted, $3) WHERE resource = $1 "
    "RETURNING 1), "
    "r AS (INSERT INTO receipts (id, resource, fence, owner, client, upstream, method, path, "
    "status, created_at, forwarded_at, instance, kind, trace_id) "
    "SELECT $2, $1, $3, $4, $5, $6, $7, $8, 'pending', $9, $9, $10, 'session', $11 FROM f) "
    "SELECT EXISTS (SELECT 1 FROM receipts o WHERE o.resource = $1 "
    "AND o.status = 'pending' AND o.fence < $3) AS ahead"
)
# The same question later, while the call waits. Asked as two questions, not as one with
# `fence < $2 OR turn < $3`: a plan for any $3 cannot leave out the turn a call outside a
# serial rule does not have (NULL), and so read every pending call of the resource to test
# it; the fence alone is a range of `receipts_pending`.
_AHEAD = (
    "SELECT EXISTS (SELECT 1 FROM receipts WHERE resource = $1 AND status = 'pending' "
    "AND fence < $2) OR ($3::bigint IS NOT NULL AND EXISTS (SELECT 1 FROM receipts "
    "WHERE resource = $1 AND status = 'pending' AND turn < $3))"
)

# An outcome onto a receipt no longer `pending` (a late one, decided under the receipt's lock):
# $1 to $9 are the outcome as stored (`_outcome_args`; a session object of None keeps the one
# there), $10 whether it is late, $11 whether it settles the key (its retention starts).
_RECORD_LOCKED = (
    "WITH r AS (UPDATE receipts SET status = $2, http_status = $3, error = $4, late = $10, "
    "forwarded_at = CASE WHEN $5::float8 IS NOT NULL THEN coalesce(forwarded_at, $5) END, "
    f"completed_at = {_NOW}, replayable = $6, response_headers = $7, "
    "response_body = $8, session = coalesce($9, session) WHERE id = $1 "
    "RETURNING resource, idempotency_key, completed_at), "
    "k AS (UPDATE idempotency_keys k SET expires_at = r.completed_at + k.retention_s FROM r "
    "WHERE $11 AND k.resource = r.resource AND k.key = r.idempotency_key "
    "AND k.receipt_id = $1) SELECT count(*) FROM r"
)
# The outcomes of `pending` receipts, each as `_RECORD_LOCKED`'s parameters, one array a
# parameter (schema 10, gateway.store.pg_outcomes): the ids of the receipts that took theirs.
_RECORD_PENDING = (
    "SELECT record_outcomes($1::text[], $2::text[], $3::integer[], $4::text[], "
    "$5::float8[], $6::boolean[], $7::text[], $8::bytea[], $9::text[], $10::boolean[], "
    "$11::boolean[]) AS id"
)

_SETTLE_KEY = (
    "UPDATE idempotency_keys SET expires_at = $4 + retention_s "
    "WHERE resource = $1 AND key = $2 AND receipt_id = $3"
)

_GRANT = (
    "WITH f AS (UPDATE fences SET issued = $3 WHERE resource = $1) "
    "INSERT INTO leases (resource, owner, fence, client, acquire_key, state, acquired_at, "
    "renewed_at, expires_at, ended_at) VALUES ($1, $2, $3, $4, $5, 'held', $6, $6, $7, NULL) "
    "ON CONFLICT (resource) DO UPDATE SET owner = excluded.owner, fence = excluded.fence, "
    "client = excluded.client, acquire_key = excluded.acquire_key, state = 'held', "
    "acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at, "
    "expires_at = excluded.expires_at, ended_at = NULL"
)


# An instance's heartbeat is a lease (gateway.core.liveness): renewed only while not silent.
# It also reads the WAL position (a position gone back is a new epoch) and the replication
# settings (§19).
_HEARTBEAT = (
    f"UPDATE instances SET heartbeat_at = {_NOW} WHERE id = $1 "
    f"AND heartbeat_at > {_NOW} - $2 RETURNING id, "
    f"(pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint AS lsn, {pg_sync.SETTINGS}"
)
# A silent instance is ended before a peer recovers its receipts: its heartbeat is set back a
# whole lease, so that no renewal can pass after this commits, whatever time the database's
# clock gave it. Taking the row's lock also orders the two: a renewal the database accepted
# but had not yet committed when the sweeper judged the instance silent is waited for, and
# the instance it renewed (it may forward its calls again) is not ended: not returned here,
# its receipts stay `pending`.
_END_SILENT = (
    "UPDATE instances SET heartbeat_at = heartbeat_at - $2 WHERE id = ANY($1) "
    f"AND heartbeat_at < {_NOW} - $2 RETURNING id"
)
# An instance id is taken once, never reused: ON CONFLICT, the caller tries the next one.
_CLAIM_INSTANCE = (
    f"INSERT INTO instances (id, started_at, heartbeat_at) VALUES ($1, {_NOW}, {_NOW}) "
    "ON CONFLICT (id) DO NOTHING RETURNING id"
)


async def _keep_session(conn: Any) -> None:
    """Connections go back to the pool as they are: the store changes no session state (only
    `SET LOCAL` and transaction-scoped advisory locks), so the reset round trip is skipped.
    asyncpg still rolls back a transaction left open."""


def _prefixed(row: Any, prefix: str) -> dict[str, Any]:
    return {key[len(prefix) :]: value for key, value in row.items() if key.startswith(prefix)}


# The connection went away or broke under a statement (a killed backend, a failover, a
# protocol state left behind by a cut connection, a timeout): it is closed rather than given
# back to the pool, and whether the statement committed is unknown to this replica.
_LOST_CONNECTION: tuple[type[BaseException], ...] = (
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.AdminShutdownError,
    OSError,
    TimeoutError,
)


class _CommitUnheard(pg_sync.MaybeCommitted):
    """A transaction whose COMMIT was sent on a connection lost before its answer."""


def _database_errors() -> tuple[type[BaseException], ...]:
    return (asyncpg.PostgresError, NoWritableHost, *_LOST_CONNECTION)


def _refused_by_server(exc: BaseException) -> bool:
    """Whether a statement failed on what it was sent, rather than on the way there
    (`_LOST_CONNECTION`): the server refused it, or asyncpg could not encode an argument,
    which it raises as the server's own `DataError` would be."""
    cause = exc.__cause__
    return isinstance(cause, asyncpg.PostgresError) and not isinstance(cause, _LOST_CONNECTION)


async def _record_pending(conn: Any, rows: Sequence[Row]) -> set[str]:
    """`_RECORD_PENDING` for these outcomes: the ids of the receipts that took theirs."""
    return {row["id"] for row in await conn.fetch(_RECORD_PENDING, *zip(*rows, strict=True))}


def _admission_args(
    call: Call,
    receipt_id: str,
    owner: str | None,
    attempt: int,
    instance: str,
    now: float | None = None,
) -> tuple[Any, ...]:
    """The parameters of an admission's write (`_ADMIT`, `_ADMIT_FRESH`); `now`, the
    database's time read under the lock, is `_ADMIT`'s only (`admit_fresh` reads its own)."""
    return (
        call.resource,
        receipt_id,
        call.fence,
        owner,
        call.client,
        call.upstream,
        call.method,
        call.path,
        call.idempotency_key,
        call.fingerprint,
        attempt,
        *(() if now is None else (now,)),
        instance,
        call.retention_s,
        1 if call.serial else 0,
        mcp_json(call.mcp),
        call.trace_id,
    )


class PostgresStore:
    shared = True  # any number of replicas admit calls on one database
    writes_in_order = False  # each on a pooled connection of its own
    open_warnings: tuple[tuple[str, str], ...] = ()

    def __init__(
        self,
        url: str,
        *,
        instance: str,
        durability: str = "strict",
        before_commit: Callable[[], None] = lambda: None,
        heartbeat_interval_s: float = 1.0,
        pool_min: int = POOL_MIN,
        pool_max: int = POOL_MAX,
        replication: Mode = "async",
        sync_wait_s: float = 5.0,
        fence_gap: int = DEFAULT_GAP,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.url = url
        self.instance = self._first_instance = instance
        self._generation = 0  # how many instance ids this process has taken before
        self._interval = heartbeat_interval_s
        self._heartbeat_sent: float | None = None  # monotonic; see gateway.core.liveness
        self._floors_at_claim = 0  # the link's `floors_seen` when this instance id was taken
        self._heartbeat_turn = asyncio.Lock()
        self._relaxed = durability == "relaxed"
        self._before_commit = before_commit
        self._pool_size = (pool_min, pool_max)
        self._new_id = MonotonicUlid()
        self._pool: Any = None
        self.recovered: dict[str, int] = {}  # nothing at open: peers may be serving (§14)
        self._link = PrimaryLink(
            url,
            instance=lambda: self.instance,
            mode=replication,
            sync_wait_s=sync_wait_s,
            fence_gap=fence_gap,
            connect_timeout_s=connect_timeout_s,
            start_timeout_s=start_timeout_s,
            pool_size=(pool_min, pool_max),
            command_timeout_s=COMMAND_TIMEOUT_S,
        )
        # Receipts that may have been admitted by a commit the gateway took for failed (one
        # that did not wait for the synchronous standby, §19; an `admit_fresh` whose connection
        # was lost): never forwarded, they are completed `not_sent`, with the error each is
        # kept with, at the next heartbeat that reaches a store taking writes. Each is kept
        # with when it was noted (monotonic): one not there yet is looked for again, for a
        # while (`_settle_unsent`).
        self._unsent: dict[str, tuple[str, float]] = {}
        self._outcomes = OutcomeBatches(
            lambda rows: self._run(lambda conn: _record_pending(conn, rows), writes=True),
            _refused_by_server,
        )

    @property
    def replication_problem(self) -> str | None:
        return self._link.replication_problem

    def drain_epoch_changes(self) -> list[EpochChange]:
        return self._link.drain()

    async def latest_epoch_change(self) -> EpochChange | None:
        return await self._run(pg_epochs.latest_change, writes=False)

    async def fence_floors(self) -> floors.Floors:
        return await self._run(postgres_floors.read_floors, writes=False)

    # -- life cycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        if self._link.sync and self._relaxed:
            raise PostgresStartupError(
                "GATEWAY_REPLICATION=sync needs GATEWAY_DURABILITY=strict: a relaxed commit "
                "waits for no standby"
            )
        try:
            self._pool = await self._link.open(_keep_session)
        except _database_errors() as exc:
            raise StoreUnavailable(f"cannot connect to PostgreSQL: {_one_line(exc)}") from exc
        try:
            async with self._pool.acquire() as conn:
                synchronous_commit, autovacuum = await conn.fetchrow(_SETTINGS)
                if not self._relaxed and synchronous_commit not in _DURABLE_SETTINGS:
                    raise PostgresStartupError(
                        f"durability strict needs the PostgreSQL setting synchronous_commit "
                        f"to be on, remote_write or remote_apply; it is {synchronous_commit!r}"
                    )
                if autovacuum == "off":
                    self.open_warnings = (("postgres_autovacuum_off", _NO_AUTOVACUUM),)
                async with conn.transaction():
                    await self._migrate(conn)
                    last = await conn.fetchval("SELECT max(id) FROM receipts")
                silent_after_s = liveness.SILENT_INTERVALS * self._interval
                await self._link.start(conn, silent_after_s)
                await self._take_instance_id(conn)
        except BaseException as exc:
            await self._pool.close()
            self._pool = None
            if isinstance(exc, _database_errors()):
                raise StoreUnavailable(
                    f"PostgreSQL could not be prepared: {_one_line(exc)}"
                ) from exc
            raise
        if last is not None:
            self._new_id.continue_after(last)  # this process's ids keep their order

    async def _migrate(self, conn: Any) -> None:
        """Create or migrate the schema, by version, under an advisory lock: replicas that
        start together take turns, and the later ones find it done."""
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_version ("
            "version integer PRIMARY KEY, applied_at double precision NOT NULL)"
        )
        version = await conn.fetchval("SELECT coalesce(max(version), 0) FROM schema_version")
        if version > SCHEMA_VERSION:
            raise PostgresStartupError(
                f"the PostgreSQL schema is version {version}, newer than this gateway knows "
                f"({SCHEMA_VERSION}): upgrade the gateway"
            )
        for step in range(version + 1, SCHEMA_VERSION + 1):
            script = resources.files("gateway.store").joinpath(_MIGRATIONS[step]).read_text()
            await conn.execute(script)
            await conn.execute(
                f"INSERT INTO schema_version (version, applied_at) VALUES ($1, {_NOW})", step
            )

    async def _take_instance_id(self, conn: Any) -> None:
        """Go on under the first id of `first`, `first.1`, `first.2`… that no instance ever
        had: an id that was ever silent stays dead (its receipts may be being recovered), and
        a restarted or duplicated `GATEWAY_INSTANCE_ID` never shares a heartbeat."""
        while True:
            candidate = liveness.next_instance_id(self._first_instance, self._generation)
            sent, floors = time.monotonic(), self._link.floors_seen
            if await conn.fetchval(_CLAIM_INSTANCE, candidate) is not None:
                self.instance, self._heartbeat_sent = candidate, sent
                self._floors_at_claim = floors
                return
            self._generation += 1

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    # -- transactions -------------------------------------------------------------------------

    def _pool_or_fail(self) -> Any:
        if self._pool is None:
            raise StoreUnavailable("the store is not open")
        return self._pool

    def _commit_hook(self) -> None:
        try:
            self._before_commit()
        except Exception as exc:
            raise StoreUnavailable(f"the store could not commit: {exc}") from exc

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[Any]:
        """A pooled connection; one that failed below SQL is closed, and the pool opens a
        fresh one when next asked (so a replica reconnects by itself after an outage).

        A connection lost usually means the server restarted or cut all of this replica's
        connections: the idle ones in the pool are then dead too, and asyncpg can hand one
        out in a confused protocol state (`InternalClientError`), so all are replaced (not
        after a timeout, which only says that one statement was slow)."""
        pool = self._pool_or_fail()
        async with pool.acquire() as conn:
            try:
                yield conn
            except (*_LOST_CONNECTION, asyncpg.ReadOnlySQLTransactionError) as exc:
                # asyncpg has already let go of a connection it saw close. A server that no
                # longer accepts writes (a demoted primary) is left for whichever host does
                # (docs/contract.md §19): its connections are replaced like lost ones.
                with contextlib.suppress(asyncpg.InterfaceError):
                    conn.terminate()
                if not isinstance(exc, TimeoutError):  # a slow statement says nothing of others
                    await pool.expire_connections()
                raise

    async def _tx(self, op: Callable[[Any], Awaitable[T]], *, relaxed: bool = False) -> T:
        """Run `op(conn)` as one transaction. `relaxed`: an admission or outcome, which
        `relaxed` durability does not wait for the disk for; everything else always does.
        A deadlock or serialization failure runs it again (no effect was committed)."""
        begin = (
            "BEGIN; SET LOCAL synchronous_commit TO off" if relaxed and self._relaxed else "BEGIN"
        )
        for attempt in range(1, _RETRIES + 1):
            committing = False  # the COMMIT may have reached the server, heard or not
            try:
                async with self._connection() as conn:
                    await conn.execute(begin)
                    try:
                        result = await op(conn)
                        self._commit_hook()
                        committing = True
                        unreplicated = await self._link.commit(conn)
                        if unreplicated is not None:  # committed on the primary alone
                            raise pg_sync.NotReplicated(f"the store failed: {unreplicated}", result)
                    except BaseException:
                        if not conn.is_closed():
                            try:
                                await conn.execute("ROLLBACK")
                            except _database_errors():
                                pass
                        raise
                    return result
            except (asyncpg.DeadlockDetectedError, asyncpg.SerializationError) as exc:
                if attempt == _RETRIES:
                    raise StoreUnavailable(f"the store failed: {_one_line(exc)}") from exc
            except _database_errors() as exc:
                if committing and isinstance(exc, _LOST_CONNECTION):  # committed, or not
                    raise _CommitUnheard(f"the store failed: {_one_line(exc)}", result) from exc
                raise StoreUnavailable(f"the store failed: {_one_line(exc)}") from exc
        raise AssertionError("unreachable")

    async def _run(self, op: Callable[[Any], Awaitable[T]], *, writes: bool) -> T:
        """One statement or a few independent ones, each its own (autocommit) transaction:
        for reads, and for writes whose checks are in the statement itself."""
        try:
            async with self._connection() as conn:
                if writes:
                    self._commit_hook()  # before the implicit COMMIT: nothing is written
                return await op(conn)
        except _database_errors() as exc:
            raise StoreUnavailable(f"the store failed: {_one_line(exc)}") from exc

    # -- admission (docs/contract.md §3 steps 4 to 6, §4) --------------------------------------

    async def admit(self, call: Call) -> Admitted | Replayed | Refused:
        """One round trip when the call is one `admit_fresh` can admit (`_fresh_decision`) and
        it does; otherwise BEGIN, lock, read, write, COMMIT: five (asyncpg pipelines none of
        them: each waits for the one before), after the one `admit_fresh` took if it was
        asked. Both take the resource's lock first, so admissions of one resource serialize
        alike whichever path each takes.

        Under `GATEWAY_REPLICATION=sync` an admission whose commit did not wait for the
        synchronous standby is `StoreUnavailable` (nothing is forwarded), and a `pending`
        receipt it wrote all the same is completed `not_sent` later (docs/contract.md §19).
        So is one `admit_fresh` may have committed on a connection lost before its answer:
        a statement commits whole, lock wait included, whether or not anyone hears it."""
        self._refuse_unreplicated()
        fresh = self._fresh_decision(call)
        if fresh is not None:
            owner, attempt = fresh
            # The replica's clock, not the database's, which is read under the lock:
            # `checkpoint_rows.since` allows for the difference.
            receipt_id = self._new_id()
            try:
                admitted = await self._run(
                    lambda conn: self._admit_fresh(conn, call, receipt_id, owner, attempt),
                    writes=True,
                )
            except StoreUnavailable as exc:
                if isinstance(exc.__cause__, _LOST_CONNECTION):
                    self._unsent[receipt_id] = ("store_unavailable", time.monotonic())
                raise
            if admitted is not None:
                return admitted
        try:
            return await self._tx(lambda conn: self._admit(conn, call), relaxed=True)
        except pg_sync.MaybeCommitted as exc:  # unreplicated, or its COMMIT unheard
            if isinstance(exc.result, Admitted):
                self._unsent[exc.result.receipt_id] = (exc.reason, time.monotonic())
            raise

    def _refuse_unreplicated(self, locked: Any = None) -> None:
        """Under `sync`: admit nothing while a replication check fails, or in a transaction
        that does not run under synchronous replication (`locked`: its settings)."""
        if not self._link.sync:
            return
        problem = self._link.replication_problem
        if problem is None and locked is not None:
            problem = pg_sync.problem_of(locked)
            self._link.note(problem)
        if problem is not None:
            raise StoreUnavailable(f"synchronous replication is not in place: {problem}")

    def _fresh_decision(self, call: Call) -> tuple[str | None, int] | None:
        """What `fences.check` and `idempotency.decide` answer `call` in the state
        `admit_fresh` admits in (the owner its receipt records, the attempt), or None when
        the call is not one to ask it about.

        Only under strict durability with async replication: `relaxed` turns
        `synchronous_commit` off for the admission's transaction, and `sync` watches the
        admission's COMMIT (`self._link.commit`), so both keep the transaction. A
        gateway-issued lease is read and checked, and a session takes no key: the full path.
        """
        if self._relaxed or self._link.sync or call.issuer != "external":
            return None
        if call.idempotency_key is None or call.fingerprint is None:
            return None
        # admit_fresh's state: the highest accepted fence and every raise at most the token,
        # no hold (docs/contract.md §18), no key record and no earlier attempt with the key.
        code, owner = fences.check(
            call.issuer,
            call.fence,
            0,  # not looked at for an external issuer
            call.fence,
            None,
            call.owner,
            call.client,
            call.clients_configured,
            fences.Bound(below=call.fence),
        )
        decision = idempotency.decide(None, call.fingerprint, call.retry_statuses)
        if code is not None or not isinstance(decision, idempotency.NewAttempt):
            return None
        return owner, decision.attempt

    async def _admit_fresh(
        self, conn: Any, call: Call, receipt_id: str, owner: str | None, attempt: int
    ) -> Admitted | None:
        """Steps 4 to 6 in one statement (`admit_fresh`): the `pending` receipt when the
        resource's state was the one `_fresh_decision` answered for; None, with nothing
        written, when it was not, when this instance made a receipt of the resource after
        the id made here (an admission that took the lock first: a new id under the lock
        keeps ids in creation order, docs/contract.md §7), or when the statement lost a
        deadlock (the full path then decides, and retries)."""
        try:
            row = await conn.fetchrow(
                _ADMIT_FRESH,
                *_admission_args(call, receipt_id, owner, attempt, instance := self.instance),
            )
        except asyncpg.DeadlockDetectedError:
            return None
        except asyncpg.PostgresError as exc:
            if getattr(exc, "sqlstate", None) == _FRESH_DECLINED:
                return None
            raise
        if row is None:
            return None
        return Admitted(
            receipt_id, attempt, owner, instance, ahead=row["ahead"], turn=row["taken_turn"]
        )

    async def _admit(self, conn: Any, call: Call) -> Admitted | Replayed | Refused:
        locked = await conn.fetchrow(_LOCK_FENCES, call.resource)
        self._refuse_unreplicated(locked)
        now = locked["now"]
        key, fingerprint = call.idempotency_key, call.fingerprint
        row: Any = None  # a session has no key to read
        if key is None or fingerprint is None:
            current = await self._lease(conn, call.resource) if call.issuer == "gateway" else None
        else:  # the lease and the key's state in one read
            row = await conn.fetchrow(_ADMIT_READ, call.resource, key, now)
            current = lease_of(_prefixed(row, "l_")) if row["l_resource"] is not None else None
        known = postgres_floors.floors_of_locked(locked)
        fence_row = fence_row_of(locked)
        code, owner = fences.check(
            call.issuer,
            call.fence,
            fence_row.issued,
            floors.accepted(known, call.resource, fence_row),
            current.view(now) if current else None,
            call.owner,
            call.client,
            call.clients_configured,
            floors.bound(known, call.resource, call.issuer, fence_row),
        )
        if code is not None:
            receipt_id = self._new_id(now)
            await conn.execute(
                _INSERT_REJECTED,
                *self._rejection_args(receipt_id, call.rejection(owner, code), now),
            )
            return Refused(code, receipt_id)
        if key is None or fingerprint is None:  # a session: no step 5 (docs/contract.md §15)
            return await self._admit_session(conn, call, owner, now)

        latest = key_state(_prefixed(row, "k_")) if row["k_id"] is not None else None
        decision = idempotency.decide(
            latest, fingerprint, call.retry_statuses, int(row["pruned"] or 0)
        )
        if isinstance(decision, idempotency.Replay):
            stored = await conn.fetchrow(
                _ADVANCE_AND_REPLAY, call.resource, call.fence, decision.receipt_id
            )
            if stored is None:
                # A peer's retention pruned the key and its answer since the read (prune
                # takes no lock of the resource's): decide again on what is there now.
                return await self._admit(conn, call)
            return replayed_of(decision.receipt_id, stored)
        if isinstance(decision, idempotency.Refuse):
            receipt_id = self._new_id(now)
            rejection = call.rejection(owner, decision.code)
            await conn.execute(
                _ADVANCE_AND_REJECT,
                *self._rejection_args(receipt_id, rejection, now, key, fingerprint),
            )
            return Refused(decision.code, receipt_id, decision.receipt_id)

        receipt_id = self._new_id(now)
        instance = self.instance
        admitted = await conn.fetchrow(
            _ADMIT, *_admission_args(call, receipt_id, owner, decision.attempt, instance, now)
        )
        return Admitted(
            receipt_id,
            decision.attempt,
            owner,
            instance,
            ahead=admitted["ahead"],
            turn=admitted["turn"],
        )

    async def _admit_session(
        self, conn: Any, call: Call, owner: str | None, now: float
    ) -> Admitted:
        """Step 6 for an upgrade that passed step 4, under the resource's lock."""
        receipt_id = self._new_id(now)
        ahead = await conn.fetchval(
            _ADMIT_SESSION,
            call.resource,
            receipt_id,
            call.fence,
            owner,
            call.client,
            call.upstream,
            call.method,
            call.path,
            now,
            instance := self.instance,
            call.trace_id,
        )
        return Admitted(receipt_id, None, owner, instance, ahead=bool(ahead))

    def _rejection_args(
        self,
        receipt_id: str,
        rejection: Rejection,
        now: float | None,
        key: str | None = None,
        fingerprint: str | None = None,
    ) -> tuple[Any, ...]:
        """`_INSERT_REJECTED`'s parameters; `now` None: the database's time."""
        return rejected_values(receipt_id, rejection, key, fingerprint, now, self.instance)

    async def reject(self, rejection: Rejection) -> str:
        """One statement: nothing is decided."""
        receipt_id = self._new_id()

        async def op(conn: Any) -> str:
            await conn.execute(_INSERT_REJECTED, *self._rejection_args(receipt_id, rejection, None))
            return receipt_id

        return await self._run(op, writes=True)

    # -- outcomes (§3, "Outcome") -------------------------------------------------------------

    async def complete(self, receipt_id: str, outcome: Outcome) -> Completion:
        """Record a call's outcome. A connection lost under the write leaves unknown whether
        it committed; asking again is safe (a receipt takes one outcome, and a second
        asking finds it `unchanged`), so it is asked once more on a fresh connection rather
        than leaving the call `outcome_unknown`."""
        try:
            return await self._complete(receipt_id, outcome)
        except StoreUnavailable as exc:
            if not isinstance(exc.__cause__, _LOST_CONNECTION):
                raise
            return await self._complete(receipt_id, outcome)

    async def _complete(self, receipt_id: str, outcome: Outcome) -> Completion:
        """A `pending` receipt (the usual case) takes its outcome in one statement, with the
        other outcomes ready at the same time (`OutcomeBatches`): its share of one round
        trip. Under `relaxed` (for its `SET LOCAL`) and `sync` (whose COMMIT's wait is
        watched) each outcome takes a transaction of its own: three. Anything else locks the
        receipt and asks `gateway.core.outcomes`: four."""
        stored = self._outcome_args(receipt_id, outcome)  # encoded once, for either path
        # What the pure decision says for the `pending` receipt the statement requires.
        completion = outcomes.decide_completion("pending", outcome.status)
        args = self._record_args(stored, outcome, completion)
        if self._relaxed or self._link.sync:  # sync: the COMMIT's wait is watched (§19)
            recorded = bool(
                await self._tx(lambda conn: _record_pending(conn, [args]), relaxed=True)
            )
        else:
            recorded = await self._outcomes.record(args)
        if recorded:
            return completion
        return await self._tx(
            lambda conn: self._complete_locked(conn, receipt_id, outcome, stored), relaxed=True
        )

    @staticmethod
    def _outcome_args(receipt_id: str, outcome: Outcome) -> tuple[Any, ...]:
        """`_RECORD`'s $1 to $9: the outcome as stored, whatever it does to the receipt."""
        return (
            receipt_id,
            outcome.status,
            outcome.http_status,
            outcome.error,
            outcome.forwarded_at,
            outcome.replayable,
            *outcome_columns(outcome),
        )

    @staticmethod
    def _record_args(
        stored: tuple[Any, ...], outcome: Outcome, completion: Completion
    ) -> tuple[Any, ...]:
        """`_RECORD`'s parameters: the outcome as stored, then what `completion` makes of it."""
        late = completion is Completion.LATE
        return (*stored, late, outcomes.settles_key(completion, outcome.status))

    async def _complete_locked(
        self, conn: Any, receipt_id: str, outcome: Outcome, stored: tuple[Any, ...]
    ) -> Completion:
        row = await conn.fetchrow(
            "SELECT status FROM receipts WHERE id = $1 FOR UPDATE", receipt_id
        )
        completion = outcomes.decide_completion(row["status"] if row else None, outcome.status)
        if completion is Completion.LATE_OUTCOME:
            # The resolution stands; the tool's own answer is kept beside it for the alert.
            await conn.execute(
                "UPDATE receipts SET error = 'late_outcome', late = true, "
                "http_status = $2 WHERE id = $1",
                receipt_id,
                outcome.http_status,
            )
        elif completion in (Completion.RECORDED, Completion.LATE):
            await conn.execute(_RECORD_LOCKED, *self._record_args(stored, outcome, completion))
        return completion

    async def pending_ahead(self, resource: str, fence: int, turn: int | None) -> bool:
        """One statement, no lock: the receipts it looks for only ever leave `pending`."""
        return bool(
            await self._run(lambda conn: conn.fetchval(_AHEAD, resource, fence, turn), writes=False)
        )

    def may_forward(self, instance: str) -> bool:
        # A new epoch that applied the floor (§19) ends the instance as a lapse does.
        return (
            instance == self.instance
            and self._link.floors_seen == self._floors_at_claim
            and not liveness.lapsed(self._heartbeat_sent, time.monotonic(), self._interval)
        )

    async def mark_forwarded(self, receipt_id: str) -> bool:
        """Durable before the call leaves: the reconcile grace counts from here."""
        status: str = await self._run(
            lambda conn: conn.execute(
                f"UPDATE receipts SET forwarded_at = {_NOW} WHERE id = $1 AND status = 'pending'",
                receipt_id,
            ),
            writes=True,
        )
        return status == "UPDATE 1"

    async def session_opened(self, receipt_id: str, record: SessionRecord) -> None:
        await self._run(
            lambda conn: conn.execute(
                "UPDATE receipts SET http_status = 101, session = $2 "
                "WHERE id = $1 AND status = 'pending'",
                receipt_id,
                session_json(record),
            ),
            writes=True,
        )

    async def fence_states(self, resources: list[str]) -> dict[str, FenceState]:
        """One indexed read for every resource with open sessions: each watching replica
        asks it a few times a second, so it takes no lock."""

        async def op(conn: Any) -> dict[str, FenceState]:
            rows = await conn.fetch(
                f"SELECT f.resource, f.accepted, l.fence, l.state = 'held' AND l.expires_at > "
                f"{_NOW} AS live FROM fences f LEFT JOIN leases l ON l.resource = f.resource "
                "WHERE f.resource = ANY($1::text[])",
                resources,
            )
            return {
                row["resource"]: FenceState(row["accepted"], row["fence"], bool(row["live"]))
                for row in rows
            }

        return await self._run(op, writes=False)

    async def mark_incomplete(self, receipt_id: str) -> None:
        await self._run(
            lambda conn: conn.execute(
                "UPDATE receipts SET error = 'response_incomplete', replayable = false, "
                "response_headers = NULL, response_body = NULL "
                "WHERE id = $1 AND status <> 'reconciled'",
                receipt_id,
            ),
            writes=True,
        )

    async def resolve(
        self,
        receipt_id: str,
        outcome: Resolution,
        source: str,
        note: str | None,
        waits: ReconcileWaits,
    ) -> Receipt | ResolveRefused:
        async def op(conn: Any) -> Receipt | ResolveRefused:
            row = await conn.fetchrow(
                f"SELECT status, resource, idempotency_key, upstream, forwarded_at, created_at, "
                f"{_NOW} AS now FROM receipts WHERE id = $1 FOR UPDATE",
                receipt_id,
            )
            if row is None:
                return ResolveRefused.NOT_FOUND
            now = row["now"]
            ready_at = waits.ready_at(row["upstream"], row["forwarded_at"], row["created_at"])
            if not may_resolve(row["status"], ready_at, now):
                return ResolveRefused.NOT_RECONCILABLE
            updated = await conn.fetchrow(
                "UPDATE receipts SET status = 'reconciled', resolution = $2, "
                f"completed_at = coalesce(completed_at, $3) WHERE id = $1 "
                f"RETURNING {RECEIPT_SELECT}",
                receipt_id,
                resolution_json(outcome, source, note, now),
                now,
            )
            await conn.execute(
                _SETTLE_KEY, row["resource"], row["idempotency_key"], receipt_id, now
            )
            return receipt_of(updated)

        return await self._tx(op)

    # -- reads (§7) ---------------------------------------------------------------------------

    async def get_receipt(self, receipt_id: str) -> Receipt | None:
        async def op(conn: Any) -> Receipt | None:
            row = await conn.fetchrow(
                f"SELECT {RECEIPT_SELECT} FROM receipts WHERE id = $1", receipt_id
            )
            return receipt_of(row) if row else None

        return await self._run(op, writes=False)

    async def list_receipts(self, query: ReceiptQuery) -> ReceiptPage:
        sql, params = postgres_lists.receipt_list(query)

        async def op(conn: Any) -> ReceiptPage:
            rows = await conn.fetch(sql, *params)
            if not rows:
                return ReceiptPage([], None)
            last = rows[-1]
            end = postgres_lists.position(last["admitted_by"], last["id"])
            return ReceiptPage([receipt_of(row) for row in rows], end)

        return await self._run(op, writes=False)

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
        """The acquire CAS, always durable: BEGIN, lock, read, write, COMMIT."""

        async def op(conn: Any) -> AcquireResult:
            locked = await conn.fetchrow(_LOCK_FENCES, resource)
            current = await self._lease(conn, resource)
            return await self._acquire_locked(
                conn, resource, owner, ttl_s, lock_delay_s, client, acquire_key, locked, current
            )

        return await self._tx(op)

    @staticmethod
    async def _lease(conn: Any, resource: str) -> Lease | None:
        row = await conn.fetchrow(_LEASE_BY_RESOURCE, resource)
        return lease_of(row) if row else None

    @staticmethod
    async def _acquire_locked(
        conn: Any,
        resource: str,
        owner: str,
        ttl_s: float,
        lock_delay_s: float,
        client: str | None,
        acquire_key: str | None,
        locked: Any,
        current: Lease | None,
    ) -> AcquireResult:
        """The acquire CAS under the resource's lock (`locked`: its fences row and now)."""
        now: float = locked["now"]
        decision = leases.decide_acquire(current, owner, client, acquire_key, lock_delay_s, now)
        if current is not None and isinstance(decision, leases.Retried):
            return AcquireResult("retried", shown(current, now), None)
        if current is not None and isinstance(decision, leases.Held):
            return AcquireResult("held", shown(current, now), None)
        fence = floors.next_fence(
            postgres_floors.floors_of_locked(locked), resource, fence_row_of(locked)
        )
        await conn.execute(_GRANT, resource, owner, fence, client, acquire_key, now, now + ttl_s)
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

        async def op(conn: Any) -> Lease | None:
            now = await conn.fetchval(_LOCK_FENCES_IF_ANY, resource)
            current = None if now is None else await self._lease(conn, resource)
            if current is None or not leases.may_renew(current, owner, fence, client, now):
                return None
            await conn.execute(
                "UPDATE leases SET renewed_at = $2, expires_at = $3 WHERE resource = $1",
                resource,
                now,
                now + ttl_s,
            )
            return replace(current, renewed_at=now, expires_at=now + ttl_s)

        return await self._tx(op)

    async def release(
        self, resource: str, owner: str | None, fence: int | None, client: str | None = None
    ) -> Release:
        """With owner and fence None: an admin's revoke (`gateway.core.leases`)."""

        async def op(conn: Any) -> Release:
            now = await conn.fetchval(_LOCK_FENCES_IF_ANY, resource)
            current = None if now is None else await self._lease(conn, resource)
            decision = leases.decide_release(
                current, owner, fence, client, 0.0 if now is None else now
            )
            if decision.action == "release":
                await conn.execute(
                    "UPDATE leases SET state = 'released', ended_at = $2 WHERE resource = $1",
                    resource,
                    now,
                )
            elif decision.action == "free":
                await conn.execute(
                    "UPDATE leases SET state = 'released' WHERE resource = $1", resource
                )
            return decision

        return await self._tx(op)

    async def get_lease(self, resource: str) -> Lease | None:
        async def op(conn: Any) -> Lease | None:
            row = await conn.fetchrow(
                f"SELECT *, {_NOW} AS now FROM leases WHERE resource = $1", resource
            )
            return shown(lease_of(row), row["now"]) if row else None

        return await self._run(op, writes=False)

    async def list_leases(
        self, prefix: str | None, state: str | None, after: str | None, limit: int
    ) -> list[Lease]:
        clauses: list[str] = []
        params: list[object] = []
        if prefix:
            params.append(prefix)
            clauses.append(f"starts_with(resource, ${len(params)})")
        if after is not None:
            params.append(after)
            clauses.append(f"resource > ${len(params)}")
        if state == "held":
            clauses.append("state = 'held' AND expires_at > t.now")
        elif state == "expired":
            clauses.append("(state = 'expired' OR (state = 'held' AND expires_at <= t.now))")
        elif state == "released":
            clauses.append("state = 'released'")
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        params.append(limit)
        sql = (
            f"WITH t AS (SELECT {_NOW} AS now) SELECT l.*, t.now FROM leases l CROSS JOIN t "
            f"{where} ORDER BY resource LIMIT ${len(params)}"
        )

        async def op(conn: Any) -> list[Lease]:
            return [shown(lease_of(row), row["now"]) for row in await conn.fetch(sql, *params)]

        return await self._run(op, writes=False)

    async def expire_leases(self, cleanup_delay: CleanupDelay | None = None) -> list[Lease]:
        """Lock the fences rows of held leases past expiry (skipping resources another
        transaction holds: the next sweep gets them), mark them `expired` and owe their
        cleanups, in one transaction."""

        async def op(conn: Any) -> list[Lease]:
            locked = await conn.fetch(
                f"SELECT f.resource, {_NOW} AS now FROM fences f JOIN leases l "
                f"ON l.resource = f.resource WHERE l.state = 'held' AND l.expires_at <= {_NOW} "
                "ORDER BY f.resource FOR UPDATE OF f SKIP LOCKED"
            )
            if not locked:
                return []
            now = max(row["now"] for row in locked)
            rows = await conn.fetch(
                "UPDATE leases SET state = 'expired', ended_at = $2 WHERE resource = ANY($1) "
                "AND state = 'held' AND expires_at <= $2 RETURNING *",
                [row["resource"] for row in locked],
                now,
            )
            expired = sorted(
                (replace(lease_of(row), state="held") for row in rows),
                key=lambda lease: lease.resource,
            )
            if cleanup_delay is not None:
                await self._schedule_cleanups(conn, expired, cleanup_delay, now)
            return expired

        return await self._tx(op)

    # -- sweeper cleanups (§9; the decisions are gateway.core.cleanups') -------------------

    @staticmethod
    async def _schedule_cleanups(
        conn: Any, expired: list[Lease], cleanup_delay: CleanupDelay, now: float
    ) -> None:
        owed = owed_cleanup_rows(expired, cleanup_delay, now)
        if owed:
            # A newer expiry replaces an older owed cleanup: whoever held the resource in
            # between superseded it, and the newest lease is the one to clean up after.
            await conn.executemany(
                "INSERT INTO cleanups (resource, lease_fence, lease_owner, due_at, attempts, "
                "sweep_fence, last_error, created_at) VALUES ($1, $2, $3, $4, 0, NULL, NULL, $5) "
                "ON CONFLICT (resource) DO UPDATE SET lease_fence = excluded.lease_fence, "
                "lease_owner = excluded.lease_owner, due_at = excluded.due_at, attempts = 0, "
                "sweep_fence = NULL, last_error = NULL, created_at = excluded.created_at",
                owed,
            )

    async def due_cleanups(self, limit: int) -> list[str]:
        """Resources whose owed cleanup is due now, the longest due first."""

        async def op(conn: Any) -> list[str]:
            return [
                row["resource"]
                for row in await conn.fetch(
                    f"SELECT resource FROM cleanups WHERE due_at <= {_NOW} ORDER BY due_at "
                    "LIMIT $1",
                    limit,
                )
            ]

        return await self._run(op, writes=False)

    async def list_cleanups(self) -> list[OwedCleanup]:
        async def op(conn: Any) -> list[OwedCleanup]:
            return [
                owed_cleanup_of(row)
                for row in await conn.fetch("SELECT * FROM cleanups ORDER BY resource")
            ]

        return await self._run(op, writes=False)

    async def claim_cleanup(
        self, resource: str, owner: str, ttl_s: float, lock_delay_s: float, recheck_s: float
    ) -> CleanupClaim:
        """Decide the next step of an owed cleanup under the resource's lock and, when it is
        to be tried, acquire the resource as `owner` (a new fence). Durable like every
        acquire; each attempt is claimed by one sweeper, whichever replica it runs in."""

        async def op(conn: Any) -> CleanupClaim:
            locked = await conn.fetchrow(_LOCK_FENCES, resource)
            now: float = locked["now"]
            row = await conn.fetchrow("SELECT * FROM cleanups WHERE resource = $1", resource)
            if row is None:
                return CleanupClaim("not_due")
            owed = owed_cleanup_of(row)
            earlier = None
            if owed.sweep_fence is not None:
                key_row = await conn.fetchrow(
                    _KEY_STATE, resource, idempotency.sweep_key(owed.sweep_fence)
                )
                earlier = key_state(key_row) if key_row else None
            current = await self._lease(conn, resource)
            verdict = cleanups.decide_claim(
                owed,
                earlier,
                current.fence if current else None,
                current.owner if current else None,
                now,
            )
            if verdict is None:  # still owed, after the lease it follows: the acquire CAS
                taken = await self._acquire_locked(
                    conn, resource, owner, ttl_s, lock_delay_s, None, None, locked, current
                )
                if taken.result == "acquired":
                    fence = taken.lease.fence
                    await conn.execute(
                        "UPDATE cleanups SET sweep_fence = $2, "
                        "attempts = attempts + 1 WHERE resource = $1",
                        resource,
                        fence,
                    )
                    return cleanups.claimed(owed, fence)
                verdict = CleanupClaim("busy", holder=taken.lease.owner)
            if cleanups.row_action(verdict) == "recheck":
                await conn.execute(
                    "UPDATE cleanups SET due_at = $2 WHERE resource = $1", resource, now + recheck_s
                )
            elif cleanups.row_action(verdict) == "forget":
                await conn.execute("DELETE FROM cleanups WHERE resource = $1", resource)
            return verdict

        return await self._tx(op)

    async def finish_cleanup(
        self,
        resource: str,
        fence: int,
        done: bool,
        retry_at: float | None = None,
        error: str | None = None,
    ) -> None:
        """After attempt `fence`: forget the cleanup when `done`, else note why and when to
        look again. A row a newer expiry replaced meanwhile is left alone (the statement's
        `sweep_fence` condition)."""

        async def op(conn: Any) -> None:
            if done:
                await conn.execute(
                    "DELETE FROM cleanups WHERE resource = $1 AND sweep_fence = $2", resource, fence
                )
            else:
                await conn.execute(
                    f"UPDATE cleanups SET due_at = coalesce($3::float8, {_NOW}), "
                    "last_error = $4 WHERE resource = $1 AND sweep_fence = $2",
                    resource,
                    fence,
                    retry_at,
                    error,
                )

        await self._run(op, writes=True)

    async def drop_cleanup(self, resource: str) -> None:
        await self._run(
            lambda conn: conn.execute("DELETE FROM cleanups WHERE resource = $1", resource),
            writes=True,
        )

    # -- checkpoints and the run view (§17) ----------------------------------------------------

    async def write_checkpoint(
        self, new: NewCheckpoint, issuer: Issuer, clients_configured: bool
    ) -> CheckpointWritten | CheckpointRefused:
        """BEGIN, lock the resource's fences row, read, decide, append, COMMIT; durable in
        relaxed mode too. Admissions and acquires take the same row lock, so the fence
        check and the append see one state of the resource's fences and lease."""

        async def op(conn: Any) -> CheckpointWritten | CheckpointRefused:
            locked = await conn.fetchrow(_LOCK_FENCES_ROW, new.resource)
            if locked is None and issuer == "external":
                # no fence was ever accepted: any token passes, and the row to lock is made
                locked = await conn.fetchrow(_LOCK_FENCES, new.resource)
            if locked is None:  # never issued: refused (fence_not_issued) without a write
                now = await conn.fetchval(f"SELECT {_NOW}")
                known = await postgres_floors.read_floors(conn)
            else:
                now, known = locked["now"], postgres_floors.floors_of_locked(locked)
            fence_row = fence_row_of(locked)
            current = await self._lease(conn, new.resource) if issuer == "gateway" else None
            row = await conn.fetchrow(cp.latest_checkpoint(_dollar), new.resource)
            latest = cp.checkpoint_of(row) if row else None
            decision = checkpoints.decide_write(
                issuer,
                new,
                fence_row,
                known,
                current.view(now) if current else None,
                latest,
                clients_configured,
            )
            if isinstance(decision, checkpoints.Refuse):
                return CheckpointRefused(decision.code)
            if isinstance(decision, checkpoints.Retry):
                return CheckpointWritten(decision.latest, created=False)
            written = decision.checkpoint(new, now, mark=self._new_id(now))
            if latest is not None:
                await conn.execute(cp.retire_checkpoint(_dollar), latest.resource, latest.seq)
            await conn.execute(
                cp.insert_checkpoint(_dollar),
                written.resource,
                written.seq,
                written.fence,
                written.owner,
                written.client,
                written.step,
                written.state,
                written.at,
                written.mark,
                new.retention_s,
            )
            return CheckpointWritten(written, created=True)

        return await self._tx(op)

    async def list_checkpoints(
        self, resource: str, before_seq: int | None, limit: int
    ) -> list[Checkpoint]:
        sql = cp.list_checkpoints(_dollar, before_seq is not None)
        args = (resource, before_seq, limit) if before_seq is not None else (resource, limit)

        async def op(conn: Any) -> list[Checkpoint]:
            return [cp.checkpoint_of(row) for row in await conn.fetch(sql, *args)]

        return await self._run(op, writes=False)

    async def run_records(self, resource: str) -> RunRecords:
        """Every read in one REPEATABLE READ snapshot, taking no lock."""

        async def op(conn: Any) -> RunRecords:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                return await self._run_records(conn, resource)

        return await self._run(op, writes=False)

    async def _run_records(self, conn: Any, resource: str) -> RunRecords:
        row = await conn.fetchrow(_RUN_HEAD, resource)
        now = row["now"]
        lease = lease_of(_prefixed(row, "l_")) if row["l_resource"] is not None else None
        checkpoint = cp.checkpoint_of(_prefixed(row, "c_")) if row["c_seq"] is not None else None
        bounds = (resource, *cp.since(checkpoint))

        async def newest(group: checkpoints.Group) -> list[Receipt]:
            rows = await conn.fetch(cp.group_receipts(_dollar, group), *bounds)
            return [receipt_of(r) for r in reversed(rows)]

        rejected, unknown = cp.rejected_and_unknown(await conn.fetch(cp.tallies(_dollar), *bounds))
        return RunRecords(
            lease=shown(lease, now) if lease else None,
            highest_fence=max(
                row["issued"] or 0,
                row["accepted"] or 0,
                floors.raised(await postgres_floors.read_floors(conn), resource),
            ),
            checkpoint=checkpoint,
            completed=await newest("completed"),
            needs_confirmation=await newest("needs_confirmation"),
            rejected=rejected,
            unknown_since=unknown,
            now=now,
        )

    async def prune_checkpoints(self) -> int:
        sql = cp.prune_checkpoints(_dollar, _NOW)

        async def op(conn: Any) -> int:
            status = await conn.execute(sql, PRUNE_BATCH)
            return int(status.split()[-1])  # "DELETE n"

        return await self._run(op, writes=True)

    # -- upkeep (§9) --------------------------------------------------------------------------

    async def heartbeat(self) -> None:
        """Renew this instance's heartbeat lease; when the database refuses (the instance was
        silent too long, and peers may be recovering its receipts), go on under a new id:
        nothing admitted under the old one is ever forwarded (`may_forward`). A heartbeat
        that hangs holds nothing up: the instance lapses by its own clock meanwhile, and the
        statement gives up once the lease it would renew is over anyway."""
        silent_after_s = liveness.SILENT_INTERVALS * self._interval
        async with self._heartbeat_turn:
            sent = time.monotonic()

            async def op(conn: Any) -> Any:
                return await conn.fetchrow(
                    _HEARTBEAT, self.instance, silent_after_s, timeout=max(silent_after_s, 1.0)
                )

            # Under sync the heartbeat is also the replication check (§19): its commit must
            # wait for the standby, and it reads the settings.
            renewed = await (self._tx(op) if self._link.sync else self._run(op, writes=True))
            if renewed is None or self._link.floors_seen != self._floors_at_claim:
                self._generation += 1
                await self._run(self._take_instance_id, writes=True)
                return
            self._heartbeat_sent = sent
            self._link.saw_position(renewed["lsn"])
            if self._link.sync:
                self._link.note(pg_sync.problem_of(renewed))
                self._refuse_unreplicated()
            await self._settle_unsent()

    async def _settle_unsent(self) -> None:
        """Complete `not_sent` the receipts of `_unsent` still `pending`: their calls were
        never forwarded. One not there may be yet to come: an admission whose connection was
        lost goes on at the server (waiting for its resource's lock) and commits unheard. It
        is looked for at each heartbeat while its instance's lease lasts; one that commits
        later still is left to the sweeper (`outcome_unknown`)."""
        wait_s = liveness.SILENT_INTERVALS * self._interval
        for receipt_id, (error, noted) in sorted(self._unsent.items()):
            completion = await self.complete(receipt_id, Outcome("not_sent", error=error))
            if completion is Completion.MISSING and time.monotonic() - noted < wait_s:
                continue
            del self._unsent[receipt_id]

    async def expire_pending(
        self, waits: ReconcileWaits, silent_after_s: float, in_flight: frozenset[str]
    ) -> dict[str, int]:
        """Turn lost `pending` receipts `outcome_unknown` (`gateway.core.receipts.is_lost`),
        judged by the database's clock; the update takes only those still `pending`, so with
        several sweepers each receipt is counted once. The receipts of an instance lost for
        its silence are taken only once that instance is ended (`_END_SILENT`)."""

        async def op(conn: Any) -> dict[str, int]:
            rows = await conn.fetch(
                f"WITH t AS (SELECT {_NOW} AS now) SELECT r.id, r.upstream, r.created_at, "
                "r.forwarded_at, r.kind, r.instance, i.heartbeat_at, t.now FROM receipts r "
                "CROSS JOIN t LEFT JOIN instances i ON i.id = r.instance "
                "WHERE r.status = 'pending'"
            )
            if not rows:
                return {}
            now = rows[0]["now"]  # one time for the whole judgement, as on SQLite
            lost = lost_receipts(rows, waits, silent_after_s, in_flight, now, self.instance)
            if not lost:
                return {}
            self._commit_hook()
            silent = {
                row["instance"]
                for row in lost
                if row["heartbeat_at"] is not None
                and liveness.silent(row["heartbeat_at"], now, silent_after_s)
            }
            if silent:
                ended = await conn.fetch(_END_SILENT, sorted(silent), silent_after_s)
                renewed = silent - {row["id"] for row in ended}
                lost = [row for row in lost if row["instance"] not in renewed]
            # the receipts locked in the order of their ids, as an outcome batch locks them
            # (gateway.store.pg_outcomes): in another order the two could deadlock
            turned = await conn.fetch(
                "UPDATE receipts SET status = 'outcome_unknown', error = 'outcome_not_recorded' "
                "WHERE id IN (SELECT id FROM receipts WHERE id = ANY($1) AND status = 'pending' "
                "ORDER BY id FOR UPDATE) AND status = 'pending' RETURNING upstream",
                [row["id"] for row in lost],
            )
            return count_by_upstream(turned)

        return await self._run(op, writes=False)

    async def prune(self, receipt_retention_s: float) -> int:
        async def op(conn: Any) -> int:
            await conn.execute(f"DELETE FROM idempotency_keys WHERE expires_at <= {_NOW}")
            # Instances are never deleted (a row for each process's start, and each lapse):
            # with its row gone an id could be taken again (docs/contract.md §9), and the
            # lapsed process that held it would renew the new one's heartbeat.
            status = await conn.execute(
                "DELETE FROM receipts WHERE id IN (SELECT r.id FROM receipts r WHERE r.status "
                f"IN ({SETTLED_SQL}) AND r.completed_at < {_NOW} - $1 AND NOT EXISTS (SELECT 1 "
                "FROM idempotency_keys k WHERE k.resource = r.resource "
                "AND k.receipt_id = r.id) LIMIT $2)",
                receipt_retention_s,
                PRUNE_BATCH,
            )
            return int(status.split()[-1])  # "DELETE n"

        return await self._run(op, writes=True)

    async def oldest_unknown_age(self) -> float:
        async def op(conn: Any) -> float:
            age = await conn.fetchval(
                f"SELECT {_NOW} - min(created_at) FROM receipts WHERE status = 'outcome_unknown'"
            )
            return float(age) if age is not None else 0.0

        return await self._run(op, writes=False)

    # -- fence floors (§18; the decisions are gateway.core.floors') ------------------------

    async def raise_fence(self, resource: str, at_least: int) -> int:
        return await self._tx(
            lambda conn: postgres_floors.raise_one(conn, resource, at_least, _LOCK_FENCES)
        )

    async def raise_fences(self, match: str, at_least: int) -> int:
        return await self._tx(lambda conn: postgres_floors.raise_glob(conn, match, at_least))

    async def apply_restore(self, gap: int, beyond: int = 0) -> RestoreReport:
        return await self._tx(lambda conn: postgres_floors.apply_restore(conn, gap, beyond))

    async def highest_fence(self) -> int:
        return await self._run(postgres_floors.highest_fence, writes=False)

    async def known_resources(self) -> list[str]:
        return await self._run(postgres_floors.known_resources, writes=False)


def _dollar(n: int) -> str:
    return f"${n}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"
