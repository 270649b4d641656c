"""PostgreSQL's admission in one statement (`admit_fresh`, schema version 9) against the full
transaction it stands in for (docs/contract.md §3 steps 4 to 6, §4, §14, §18).

For generated states of a resource (its fences row, the store's floor, epoch and raises, its
lease, the key's receipts, other calls pending) the one statement admits exactly in the
states where the full transaction admits a fresh call under an external issuer's token, with
the same receipt, key and fences, and anywhere else leaves every row as it found it. Round
trips are counted as calls into asyncpg: on a statement already prepared on its connection,
each is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.store.base import Admitted, Call, Refused, Replayed
from tests.store.conftest import make_store, pg_database
from tests.store.test_contract import call, ok

asyncpg = pytest.importorskip("asyncpg")

from gateway.store.postgres import PostgresStore  # noqa: E402

RESOURCE = "acct/1"
KEY = "k1"
FINGERPRINT = "sha256:a"


@dataclass(frozen=True)
class KeyReceipt:
    """A receipt that sent the key: the latest one is what the key record points at."""

    status: str
    fingerprint: str
    http_status: int | None
    replayable: bool
    resolution: str | None
    attempt: int


@dataclass(frozen=True)
class State:
    fences: tuple[int, int, int, int] | None  # issued, accepted, lifted, turns; None: no row
    floor: int
    epoch: int
    raises: tuple[tuple[str, int, int], ...]  # match, at_least, epoch
    lease: tuple[str, int, str | None, str, float] | None  # owner, fence, client, state, ttl
    latest: KeyReceipt | None  # with a key record pointing at it
    earlier: tuple[str, ...]  # statuses of older receipts with the key (none has a record)
    pending: tuple[tuple[int, int | None], ...]  # other keys' pending calls: fence, turn


FENCES = st.integers(1, 6)
KEY_RECEIPTS = st.builds(
    KeyReceipt,
    status=st.sampled_from(
        ["pending", "succeeded", "failed", "outcome_unknown", "reconciled", "not_sent"]
    ),
    fingerprint=st.sampled_from([FINGERPRINT, "sha256:b"]),
    http_status=st.sampled_from([None, 200, 409, 503]),
    replayable=st.booleans(),
    resolution=st.sampled_from([None, "applied", "not_applied"]),
    attempt=st.integers(1, 3),
)
STATES = st.builds(
    State,
    fences=st.none() | st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 2), FENCES),
    floor=st.sampled_from([0, 0, 3, 7]),
    epoch=st.sampled_from([0, 0, 0, 1, 2]),
    raises=st.just(())
    | st.lists(
        st.tuples(st.sampled_from(["acct/*", "other/*", "*", RESOURCE]), FENCES, st.integers(0, 2)),
        max_size=2,
        unique_by=lambda r: r[0],
    ).map(tuple),
    lease=st.none()
    | st.tuples(
        st.sampled_from(["a", "b"]),
        FENCES,
        st.sampled_from([None, "c1"]),
        st.sampled_from(["held", "held", "expired", "released"]),
        st.sampled_from([-60.0, 600.0]),
    ),
    latest=st.none() | st.none() | KEY_RECEIPTS,
    earlier=st.lists(st.sampled_from(["rejected", "succeeded", "not_sent"]), max_size=2).map(tuple),
    pending=st.lists(st.tuples(FENCES, st.none() | st.integers(1, 4)), max_size=2).map(tuple),
)
CALLS = st.builds(
    lambda fence, issuer, owner, client, configured, serial, fingerprint: replace(
        call(fence, issuer=issuer, owner=owner, fp=fingerprint, key=KEY),
        client=client,
        clients_configured=configured,
        serial=serial,
    ),
    FENCES,
    st.sampled_from(["external", "external", "gateway"]),
    st.sampled_from([None, "a", "b"]),
    st.sampled_from([None, "c1"]),
    st.booleans(),
    st.booleans(),
    st.sampled_from([FINGERPRINT, FINGERPRINT, "sha256:b"]),
)


def fresh_state_for(state: State, probe: Call) -> bool:
    """The states `admit_fresh` is for, from docs/contract.md alone: an external token at or
    above the highest accepted fence and every raise (§3, §18), no hold after a restore (§18),
    and a key never sent before (§4)."""
    accepted = state.fences[1] if state.fences else 0
    lifted = state.fences[2] if state.fences else 0
    return (
        probe.issuer == "external"
        and probe.fence >= accepted
        and all(at_least <= probe.fence for _, at_least, _ in state.raises)
        and not state.epoch > lifted
        and state.latest is None
        and all(status == "rejected" for status in state.earlier)
    )


_NOW = "SELECT extract(epoch from clock_timestamp())::float8"
_RESET = (
    "DELETE FROM receipts; DELETE FROM idempotency_keys; DELETE FROM leases; "
    "DELETE FROM fences; DELETE FROM fence_raises"
)
_RECEIPT = (
    "INSERT INTO receipts (id, resource, fence, upstream, method, path, idempotency_key, "
    "fingerprint, attempt, status, http_status, created_at, instance, turn, resolution, "
    "replayable, response_headers, response_body) VALUES ($1, $2, $3, 'tool', 'POST', '/x', "
    "$4, $5, $6, $7, $8, $9, 'elsewhere', $10, $11, $12, '[]', '\\x7b7d')"
)


async def set_state(conn: Any, state: State, now: float) -> None:
    """Only `state` in the store's tables, as the store itself would have written it by `now`."""
    await conn.execute(_RESET)
    await conn.execute("UPDATE fence_floor SET floor = $1, epoch = $2", state.floor, state.epoch)
    if state.fences is not None:
        await conn.execute(
            "INSERT INTO fences (resource, issued, accepted, lifted, turns) "
            "VALUES ($1, $2, $3, $4, $5)",
            RESOURCE,
            *state.fences,
        )
    for match, at_least, epoch in state.raises:
        await conn.execute(
            "INSERT INTO fence_raises VALUES ($1, $2, $3, $4)", match, at_least, epoch, now
        )
    if state.lease is not None:
        owner, fence, client, lease_state, ttl = state.lease
        await conn.execute(
            "INSERT INTO leases (resource, owner, fence, client, state, acquired_at, renewed_at, "
            "expires_at) VALUES ($1, $2, $3, $4, $5, $6, $6, $7)",
            RESOURCE,
            owner,
            fence,
            client,
            lease_state,
            now - 1,
            now + ttl,
        )
    n = 0
    for status in state.earlier:
        n += 1
        await conn.execute(
            _RECEIPT, f"r{n:02}", RESOURCE, 1, KEY, FINGERPRINT, None, status, 200, now - 5,
            None, None, False,
        )  # fmt: skip
    if state.latest is not None:
        k = state.latest
        resolution = json.dumps({"outcome": k.resolution}) if k.resolution else None
        n += 1
        await conn.execute(
            _RECEIPT, f"r{n:02}", RESOURCE, 1, KEY, k.fingerprint, k.attempt, k.status,
            k.http_status, now - 4, None, resolution, k.replayable,
        )  # fmt: skip
        await conn.execute(
            "INSERT INTO idempotency_keys VALUES ($1, $2, $3, 60, NULL)", RESOURCE, KEY, f"r{n:02}"
        )
    for fence, turn in state.pending:
        n += 1
        await conn.execute(
            _RECEIPT, f"r{n:02}", RESOURCE, fence, f"other-{n}", FINGERPRINT, 1, "pending", None,
            now - 3, turn, None, False,
        )  # fmt: skip


def given_or_new(receipt_id: str) -> str:
    """A receipt id `set_state` wrote, or "new" for the one admission made."""
    return receipt_id if receipt_id.startswith("r") else "new"


async def rows(conn: Any) -> dict[str, list[tuple[Any, ...]]]:
    """Every row admission may touch; a new receipt's id and times left out, so that two
    admissions of one call compare equal (its times are checked to be the database's), and
    every receipt's `admitted_by`, the id of the transaction that wrote it."""
    receipts = await conn.fetch(
        "SELECT r.*, r.id LIKE 'r__' AS given, created_at = forwarded_at AS one_time "
        "FROM receipts r ORDER BY given DESC, id"
    )
    return {
        "fences": [tuple(r) for r in await conn.fetch("SELECT * FROM fences")],
        "leases": [tuple(r) for r in await conn.fetch("SELECT * FROM leases")],
        "floor": [tuple(r) for r in await conn.fetch("SELECT * FROM fence_floor")],
        "raises": [tuple(r) for r in await conn.fetch("SELECT * FROM fence_raises ORDER BY 1")],
        "keys": [
            (r["resource"], r["key"], given_or_new(r["receipt_id"]), *tuple(r)[3:])
            for r in await conn.fetch("SELECT * FROM idempotency_keys ORDER BY key")
        ],
        "receipts": [
            tuple(
                value
                for name, value in r.items()
                if name != "admitted_by"
                and (r["given"] or name not in ("id", "created_at", "forwarded_at"))
            )
            for r in receipts
        ],
    }


def fast_only(store: PostgresStore, probe: Call) -> Callable[[Any], Any] | None:
    """The one statement alone, as `admit` runs it; None when `admit` would not ask it."""
    fresh = store._fresh_decision(probe)
    if fresh is None:
        return None
    receipt_id = store._new_id()
    return lambda conn: store._admit_fresh(conn, probe, receipt_id, *fresh)


async def both_paths(store: PostgresStore, conn: Any, state: State, probe: Call) -> None:
    now = await conn.fetchval(_NOW)
    await set_state(conn, state, now)
    before = await rows(conn)
    fast_op = fast_only(store, probe)
    fast = None if fast_op is None else await store._run(fast_op, writes=True)
    after_fast = await rows(conn)
    await set_state(conn, state, now)
    full = await store._tx(lambda c: store._admit(c, probe), relaxed=True)
    after_full = await rows(conn)

    assert (fast_op is not None) == (probe.issuer == "external")
    assert (fast is not None) == fresh_state_for(state, probe), (fast, full)
    if fast is None:
        assert after_fast == before  # nothing written, not even a fences row
        return
    assert isinstance(full, Admitted)
    assert (fast.attempt, fast.owner, fast.instance, fast.ahead, fast.turn) == (
        full.attempt,
        full.owner,
        full.instance,
        full.ahead,
        full.turn,
    )
    assert after_fast == after_full


def test_the_one_statement_admits_exactly_as_the_full_transaction(tmp_path: Path) -> None:
    url = pg_database(tmp_path)  # skips, or fails on CI, when PostgreSQL is away
    with asyncio.Runner() as runner:
        store = make_store("postgres", tmp_path)
        assert isinstance(store, PostgresStore)
        runner.run(store.open())
        conn = runner.run(asyncpg.connect(url))
        try:

            @settings(
                max_examples=400,
                deadline=None,
                database=None,  # nothing written into the working tree
                suppress_health_check=[HealthCheck.too_slow],
            )
            @given(state=STATES, probe=CALLS)
            def agree(state: State, probe: Call) -> None:
                runner.run(both_paths(store, conn, state, probe))

            agree()
        finally:
            runner.run(conn.close())
            runner.run(store.close())


# ------------------------------------------------------------------------------------------
# Round trips and today's answers
# ------------------------------------------------------------------------------------------


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements sent through any asyncpg connection of the test, one per call."""
    sent: list[str] = []
    for name in ("execute", "fetch", "fetchrow", "fetchval"):
        original = getattr(asyncpg.Connection, name)

        def counted(self: Any, query: str, *args: Any, _original: Any = original, **kw: Any):
            sent.append(query)
            return _original(self, query, *args, **kw)

        monkeypatch.setattr(asyncpg.Connection, name, counted)
    return sent


# Sessions of the test's database waiting for a lock; the others than the one asking.
LOCK_WAITS = (
    "SELECT count(*) FROM pg_stat_activity "
    "WHERE wait_event_type = 'Lock' AND datname = current_database()"
)
OTHER_SESSIONS = (
    "SELECT count(*) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


async def until(
    conn: Any, count: str, wanted: Callable[[int], bool], failure: str, seconds: float = 5.0
) -> None:
    """Ask `count` on `conn` until its answer is `wanted`; fail with `failure` after
    `seconds`."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not wanted(await conn.fetchval(count)):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(failure)
        await asyncio.sleep(0.01)


async def opened(tmp_path: Path) -> PostgresStore:
    store = make_store("postgres", tmp_path)
    assert isinstance(store, PostgresStore)
    await store.open()
    return store


class TestRoundTrips:
    async def test_a_fresh_admission_and_its_outcome_are_one_round_trip_each(
        self, tmp_path: Path, trips: list[str]
    ) -> None:
        store = await opened(tmp_path)
        try:
            await store.complete((await store.admit(call(1, key="warm"))).receipt_id, ok())
            trips.clear()  # every statement prepared: one call, one round trip
            admitted = await store.admit(call(1))
            assert isinstance(admitted, Admitted) and admitted.attempt == 1
            assert len(trips) == 1, trips
            trips.clear()
            assert await store.complete(admitted.receipt_id, ok()) == "recorded"
            assert len(trips) == 1, trips
        finally:
            await store.close()

    async def test_the_other_answers_are_todays_after_one_more_trip(
        self, tmp_path: Path, trips: list[str]
    ) -> None:
        store = await opened(tmp_path)
        try:
            done = await store.admit(call(5))
            await store.complete(done.receipt_id, ok())
            pending = await store.admit(call(5, key="busy"))
            trips.clear()
            answers = [
                await store.admit(call(4, key="new")),  # stale
                await store.admit(call(5)),  # replay
                await store.admit(call(5, fp="sha256:other")),  # the key reused
                await store.admit(call(5, key="busy")),  # in flight
            ]
            assert isinstance(answers[0], Refused) and answers[0].code == "stale_fence"
            assert isinstance(answers[1], Replayed) and answers[1].receipt_id == done.receipt_id
            assert isinstance(answers[2], Refused) and answers[2].code == "idempotency_key_reused"
            assert isinstance(answers[3], Refused)
            assert answers[3].code == "idempotency_in_flight"
            assert answers[3].holder_receipt_id == pending.receipt_id
            # each: the one statement, which wrote nothing, then the full transaction's five
            assert len(trips) == 4 * 6, trips
        finally:
            await store.close()

    async def test_a_gateway_issued_lease_takes_the_full_transaction_alone(
        self, tmp_path: Path, trips: list[str]
    ) -> None:
        store = await opened(tmp_path)
        try:
            taken = await store.acquire("g/1", "a", 30, 0, None, None)
            fenced = dict(resource="g/1", issuer="gateway", owner="a")
            await store.admit(call(taken.lease.fence, key="warm", **fenced))
            trips.clear()
            admitted = await store.admit(call(taken.lease.fence, **fenced))
            assert isinstance(admitted, Admitted) and admitted.owner == "a"
            assert len(trips) == 5, trips  # BEGIN, lock, lease and key, write, COMMIT
        finally:
            await store.close()


class TestUnderTheLock:
    """The one statement reads everything after it holds the resource's lock, so it decides
    on what the lock's previous holder committed, like the full transaction."""

    async def test_a_statement_that_waited_sees_the_holders_key_and_pending_call(
        self, tmp_path: Path
    ) -> None:
        store = await opened(tmp_path)
        holder = await asyncpg.connect(pg_database(tmp_path))
        watcher = await asyncpg.connect(pg_database(tmp_path))  # outside the holder's snapshot
        try:
            first = await store.admit(call(1, key="first"))
            await store.complete(first.receipt_id, ok())
            await holder.execute("BEGIN")
            await holder.execute("SELECT 1 FROM fences WHERE resource = $1 FOR UPDATE", RESOURCE)
            waiting = [
                asyncio.create_task(store.admit(call(2, key="taken"))),
                asyncio.create_task(store.admit(call(2, key="beside"))),
            ]
            await until(
                watcher, LOCK_WAITS, lambda n: n == 2, "the admissions never waited on the lock"
            )
            now = await holder.fetchval(_NOW)
            await holder.execute(
                _RECEIPT, "r01", RESOURCE, 1, "taken", FINGERPRINT, 1, "pending", None, now,
                None, None, False,
            )  # fmt: skip
            await holder.execute(
                "INSERT INTO idempotency_keys VALUES ($1, 'taken', 'r01', 60, NULL)", RESOURCE
            )
            await holder.execute("COMMIT")
            taken, beside = await asyncio.wait_for(asyncio.gather(*waiting), 10)
            assert isinstance(taken, Refused) and taken.code == "idempotency_in_flight"
            assert taken.holder_receipt_id == "r01"
            assert isinstance(beside, Admitted) and beside.ahead  # fence 1 is still pending
        finally:
            await watcher.close()
            await holder.close()
            await store.close()

    async def test_a_row_made_for_the_lock_is_undone_when_the_call_is_left_to_the_transaction(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A resource first seen by two at once: the one statement looked before the lock
        (no row yet), made the row meanwhile committed by the other, and found it accepted
        above its token: its statement is undone (FG001), and the full path refuses."""
        raised: list[str] = []
        fetchrow = asyncpg.Connection.fetchrow

        async def watched(self: Any, query: str, *args: Any, **kw: Any) -> Any:
            try:
                return await fetchrow(self, query, *args, **kw)
            except asyncpg.PostgresError as exc:
                raised.append(exc.sqlstate)
                raise

        monkeypatch.setattr(asyncpg.Connection, "fetchrow", watched)
        store = await opened(tmp_path)
        other = await asyncpg.connect(pg_database(tmp_path))
        watcher = await asyncpg.connect(pg_database(tmp_path))
        try:
            await other.execute("BEGIN")
            await other.execute("INSERT INTO fences (resource, accepted) VALUES ('new/1', 9)")
            admitting = asyncio.create_task(store.admit(call(1, resource="new/1")))
            await until(watcher, LOCK_WAITS, bool, "the admission never waited for the other's row")
            await other.execute("COMMIT")
            refused = await asyncio.wait_for(admitting, 10)
            assert isinstance(refused, Refused) and refused.code == "stale_fence"
            assert raised == ["FG001"]
            row = await watcher.fetchrow("SELECT * FROM fences WHERE resource = 'new/1'")
            assert (row["issued"], row["accepted"], row["turns"]) == (0, 9, 0)
            statuses = await watcher.fetch("SELECT status FROM receipts")
            assert [r["status"] for r in statuses] == ["rejected"]
        finally:
            await watcher.close()
            await other.close()
            await store.close()

    async def test_concurrent_fresh_calls_with_one_key_admit_once(self, tmp_path: Path) -> None:
        store = await opened(tmp_path)
        try:
            results = await asyncio.gather(*(store.admit(call(1, key="same")) for _ in range(20)))
            assert sum(isinstance(r, Admitted) for r in results) == 1
            refused = {r.code for r in results if isinstance(r, Refused)}
            assert refused == {"idempotency_in_flight"}
        finally:
            await store.close()


class TestPlans:
    @pytest.mark.parametrize("durability", ["strict", "relaxed"])  # admit_fresh; the full path
    async def test_admissions_and_outcomes_read_no_more_receipts_as_the_resource_has_more(
        self, tmp_path: Path, durability: str
    ) -> None:
        """A connection plans its statements on first use: here, on a new database, while
        `receipts` is empty. In those plans, for 60 calls of one resource all pending at
        once, each of these read every receipt of the resource, or every pending one, to
        keep one or none: `admit_fresh`'s check for a receipt this instance made after the
        id (twice an admission: 3,540 rows read); the full admission's read of the key's
        receipt (1,770); the calls ahead, asked at admission (1,770) and again while a call
        waits (3,300, all 60 pending); an outcome's receipt (1,770). Each now reads the
        receipts its answer depends on: none but the one an outcome is for."""
        store = PostgresStore(pg_database(tmp_path), instance="test-1", durability=durability)
        await store.open()
        calls = 60
        try:
            admitted = [await store.admit(call(1, key=f"k{n}")) for n in range(calls)]
            for each in admitted:
                assert isinstance(each, Admitted) and each.attempt == 1
                assert not each.ahead and not await store.pending_ahead(RESOURCE, 1, None)
            for each in admitted:
                assert await store.complete(each.receipt_id, ok()) == "recorded"
        finally:
            await store.close()
        read = await rows_read(pg_database(tmp_path), "receipts")
        assert read < 2 * calls, read  # the outcomes', one a call


async def rows_read(url: str, table: str) -> int:
    """Rows of `table` read, through an index or by a scan, by every session of the database
    so far: counted once they have all ended (a session's counts are published when it ends)."""
    conn = await asyncpg.connect(url)
    try:
        # until then their counts are unpublished, and the figure too low to mean anything
        await until(conn, OTHER_SESSIONS, lambda n: n == 0, "the store's sessions did not end")
        read: int = await conn.fetchval(
            "SELECT idx_tup_fetch + seq_tup_read FROM pg_stat_user_tables WHERE relname = $1",
            table,
        )
        return read
    finally:
        await conn.close()


def test_relaxed_and_sync_keep_the_transaction(tmp_path: Path) -> None:
    url = pg_database(tmp_path)
    relaxed = PostgresStore(url, instance="r", durability="relaxed")
    sync = PostgresStore(url, instance="s", replication="sync")
    strict = PostgresStore(url, instance="t")
    probe = call(1)
    assert relaxed._fresh_decision(probe) is None
    assert sync._fresh_decision(probe) is None
    assert strict._fresh_decision(probe) == (None, 1)  # no owner presented; attempt 1


class _CuttableProxy:
    """A TCP relay to PostgreSQL whose client sides can be cut while the server sides stay
    open: the database goes on with what it was sent, and its answers fall on the floor.
    `cut_at_commit`: the next COMMIT a client sends goes to the server, and that client's
    side is cut before it hears the answer."""

    def __init__(self) -> None:
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.port = 0
        self.cut_at_commit = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 5432)
        self._writers.append(writer)
        muted = False

        async def inward() -> None:
            nonlocal muted
            while data := await reader.read(65536):
                up_writer.write(data)
                if self.cut_at_commit and b"COMMIT" in data:
                    self.cut_at_commit, muted = False, True
                    await asyncio.sleep(0.2)  # the server commits; its answer is not passed
                    writer.transport.abort()
                    return

        async def outward() -> None:
            while data := await up_reader.read(65536):
                if not writer.is_closing() and not muted:
                    writer.write(data)

        await asyncio.gather(inward(), outward(), return_exceptions=True)
        up_writer.close()

    def cut(self) -> None:
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()


@contextlib.asynccontextmanager
async def _through_proxy(tmp_path: Path) -> AsyncIterator[tuple[str, _CuttableProxy, Any, Any]]:
    """The database's URL, a `_CuttableProxy`, a store whose connections go through it, and
    a direct connection to look at what the database holds."""
    url = pg_database(tmp_path)
    proxy = _CuttableProxy()
    await proxy.start()
    store = PostgresStore(url.replace(":5432/", f":{proxy.port}/"), instance="test-1")
    await store.open()
    direct = await asyncpg.connect(url)
    try:
        yield url, proxy, store, direct
    finally:
        await direct.close()
        await proxy.close()
        await store.close()


@pytest.mark.parametrize("heartbeat_first", [False, True], ids=["commit_first", "heartbeat_first"])
async def test_an_admission_committed_on_a_lost_connection_ends_not_sent(
    tmp_path: Path, heartbeat_first: bool
) -> None:
    """`admit_fresh` commits whole once sent, lock wait included, whether or not its answer
    arrives: an admission whose connection was lost under it is refused (nothing forwarded),
    and a `pending` receipt it may have written is completed `not_sent` at a heartbeat, so the
    key is free for the retry; also when a heartbeat ran before it committed and found none
    (`heartbeat_first`)."""
    from gateway.core.errors import StoreUnavailable

    async with _through_proxy(tmp_path) as (url, proxy, store, direct):
        assert isinstance(await store.admit(call(1, key="first")), Admitted)
        locker = await asyncpg.connect(url)
        tx = locker.transaction()
        await tx.start()
        await locker.execute("SELECT 1 FROM fences WHERE resource = $1 FOR UPDATE", RESOURCE)
        admitting = asyncio.create_task(store.admit(call(2, key="second")))
        await until(direct, LOCK_WAITS, bool, "the admission never waited for the lock")
        proxy.cut()
        with pytest.raises(StoreUnavailable):
            await admitting
        if heartbeat_first:
            await store.heartbeat()  # before the lock is let go: no receipt to complete yet
        await tx.commit()  # the waiting statement goes on, and commits unheard
        await locker.close()
        for _ in range(200):
            if await direct.fetchval(
                "SELECT status FROM receipts WHERE idempotency_key = 'second'"
            ):
                break
            await asyncio.sleep(0.02)
        await store.heartbeat()
        row = await direct.fetchrow(
            "SELECT status, error FROM receipts WHERE idempotency_key = 'second'"
        )
        assert (row["status"], row["error"]) == ("not_sent", "store_unavailable")
        retried = await store.admit(call(2, key="second"))
        assert isinstance(retried, Admitted) and retried.attempt == 2


async def test_a_full_admission_whose_commit_answer_is_lost_ends_not_sent(tmp_path: Path) -> None:
    """The full transaction (every call under a gateway-issued lease, and every call under
    `relaxed` or `sync`) commits whole once its COMMIT reached the server, heard or not: as
    `admit_fresh`'s, a receipt it wrote ends `not_sent` at the next heartbeat (it stayed
    `pending`, then `outcome_unknown`: a call never sent, its key blocked until reconciled)."""
    from gateway.core.errors import StoreUnavailable

    async with _through_proxy(tmp_path) as (_url, proxy, store, direct):
        fence = (await store.acquire("gw/1", "w1", 60, 0, None, None)).lease.fence
        proxy.cut_at_commit = True
        with pytest.raises(StoreUnavailable):
            await store.admit(call(fence, resource="gw/1", issuer="gateway", owner="w1"))
        row = await direct.fetchrow("SELECT status FROM receipts WHERE resource = 'gw/1'")
        assert row is not None and row["status"] == "pending"  # committed, unheard
        await store.heartbeat()
        row = await direct.fetchrow("SELECT status, error FROM receipts WHERE resource = 'gw/1'")
        assert (row["status"], row["error"]) == ("not_sent", "store_unavailable")
        retried = await store.admit(call(fence, resource="gw/1", issuer="gateway", owner="w1"))
        assert isinstance(retried, Admitted) and retried.attempt == 2
