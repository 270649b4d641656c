"""What only the SQLite backend does: the one-process lock, recovery at start, group commit."""

import asyncio
import os
import sqlite3
import threading
from pathlib import Path

import pytest

from gateway.store import sqlite as sqlite_module
from gateway.store.base import Admitted, StoreUnavailable
from gateway.store.sqlite import SqliteStore, StoreLocked
from tests.store.test_contract import NO_WAIT, call, ok


class TestSingleProcess:
    """One gateway process per database file, whatever path reaches it; a restart finds the
    earlier run's pending receipts."""

    async def test_second_store_on_one_file_is_refused(self, tmp_path: Path) -> None:
        first = SqliteStore(tmp_path / "gw.db", instance="one")
        await first.open()
        try:
            with pytest.raises(StoreLocked):
                await SqliteStore(tmp_path / "gw.db", instance="two").open()
        finally:
            await first.close()

    async def test_a_second_path_to_the_same_database_is_refused(self, tmp_path: Path) -> None:
        first = SqliteStore(tmp_path / "gw.db", instance="one")
        await first.open()
        os.symlink(tmp_path / "gw.db", tmp_path / "alias.db")
        try:
            with pytest.raises(StoreLocked):
                await SqliteStore(tmp_path / "alias.db", instance="two").open()
        finally:
            await first.close()

    async def test_pending_receipts_of_an_earlier_run_become_unknown(self, tmp_path: Path):
        first = SqliteStore(tmp_path / "gw.db", instance="one")
        await first.open()
        admitted = await first.admit(call(3))
        await first.close()
        second = SqliteStore(tmp_path / "gw.db", instance="two")
        await second.open()
        try:
            assert (await second.get_receipt(admitted.receipt_id)).status == "outcome_unknown"
            assert (await second.admit(call(2, key="late"))).code == "stale_fence"
        finally:
            await second.close()


class TestGroupCommit:
    """Concurrent admissions share commits: fewer fsyncs than calls, each still durable."""

    @pytest.mark.parametrize("durability", ["strict", "relaxed"])
    async def test_concurrent_admissions_share_commits(
        self, tmp_path: Path, durability: str
    ) -> None:
        store = SqliteStore(tmp_path / "gw.db", instance="one", durability=durability)
        await store.open()
        try:
            before = store.committer.batches
            await asyncio.gather(
                *(store.admit(call(1, key=f"k{i}", resource=f"r/{i}")) for i in range(200))
            )
            assert store.committer.batches - before < 100
        finally:
            await store.close()

    async def test_a_failing_operation_does_not_sink_its_batch(self, tmp_path: Path) -> None:
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()

        def broken(conn):
            conn.execute("INSERT INTO no_such_table VALUES (1)")

        try:
            before = store.committer.batches
            results = await asyncio.gather(
                store.admit(call(1, key="a")),
                store.committer.submit(broken),
                store.admit(call(1, key="b")),
                return_exceptions=True,
            )
            assert store.committer.batches - before == 1  # all three in one transaction
            assert [type(r).__name__ for r in results] == [
                "Admitted",
                "StoreUnavailable",
                "Admitted",
            ]
        finally:
            await store.close()

    @pytest.mark.parametrize("ending", ["disk_full", "or_rollback"])
    async def test_a_failure_that_ends_the_transaction_sinks_only_its_own_operation(
        self, tmp_path: Path, ending: str
    ) -> None:
        """SQLite answers some failures by rolling the whole transaction back, savepoints and
        all (a full disk; a constraint `OR ROLLBACK`): the batch is begun again without the
        failing operation, and the others still commit."""
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()

        def prepare(conn: sqlite3.Connection) -> None:
            conn.execute("CREATE TABLE blobs (b BLOB)")
            conn.execute("CREATE TABLE keys (k INTEGER PRIMARY KEY)")
            conn.execute("INSERT INTO keys VALUES (1)")

        def failing(conn: sqlite3.Connection) -> None:
            if ending == "disk_full":  # SQLITE_FULL: more than max_page_count allows
                conn.execute("INSERT INTO blobs VALUES (zeroblob(4000000))")
            else:
                conn.execute("INSERT OR ROLLBACK INTO keys VALUES (1)")

        try:
            await store.committer.submit(prepare)
            await store.admit(call(1, key="warm"))  # the receipts' first pages are there
            pages = await store.committer.submit(
                lambda conn: conn.execute("PRAGMA page_count").fetchone()[0]
            )
            await store.committer.submit(  # room for a few receipts, not for 4 MB
                lambda conn: conn.execute(f"PRAGMA max_page_count={pages + 64}").fetchone()
            )
            before = store.committer.batches
            first, failed, second = await asyncio.gather(
                store.admit(call(1, key="a")),
                store.committer.submit(failing),
                store.admit(call(1, key="b")),
                return_exceptions=True,
            )
            assert store.committer.batches - before == 1  # all three in one transaction
            assert isinstance(failed, StoreUnavailable)
            assert isinstance(first, Admitted) and isinstance(second, Admitted)
            for admitted in (first, second):
                assert (await store.get_receipt(admitted.receipt_id)).status == "pending"
        finally:
            await store.close()

    async def test_a_closed_store_refuses_reads_and_writes_as_unavailable(
        self, tmp_path: Path
    ) -> None:
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()
        admitted = await store.admit(call(1, key="a"))
        await store.close()
        with pytest.raises(StoreUnavailable):
            await store.admit(call(1, key="late"))
        with pytest.raises(StoreUnavailable):
            await store.get_receipt(admitted.receipt_id)
        await store.close()  # a second close does nothing


class TestWhereTheWorkRuns:
    """A batch's short operations run on the event loop's thread, its bulk ones and its
    COMMIT in the writer thread (gateway.store.group_commit)."""

    async def test_short_operations_on_the_loop_bulk_and_commit_in_the_writer(
        self, tmp_path: Path
    ) -> None:
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()
        threads: dict[str, str] = {}

        def short(conn: sqlite3.Connection) -> None:
            threads["short"] = threading.current_thread().name

        def bulk(conn: sqlite3.Connection) -> None:
            threads["bulk"] = threading.current_thread().name

        def on_statement(statement: str) -> None:
            if statement == "COMMIT":
                threads["commit"] = threading.current_thread().name

        store._writer_conn.set_trace_callback(on_statement)
        try:
            await asyncio.gather(
                store.committer.submit(short), store.committer.submit(bulk, bulk=True)
            )
            assert threads["short"] == threading.current_thread().name
            assert threads["bulk"].startswith("sqlite-writer")
            assert threads["commit"].startswith("sqlite-writer")
        finally:
            await store.close()

    async def test_a_failing_bulk_operation_does_not_sink_its_batch(self, tmp_path: Path) -> None:
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()

        def broken(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM no_such_table")

        try:
            before = store.committer.batches
            admitted, failed = await asyncio.gather(
                store.admit(call(1, key="a")),
                store.committer.submit(broken, bulk=True),
                return_exceptions=True,
            )
            assert store.committer.batches - before == 1
            assert type(failed).__name__ == "StoreUnavailable"
            assert (await store.get_receipt(admitted.receipt_id)).status == "pending"
        finally:
            await store.close()

    async def test_a_batch_that_is_all_the_work_commits_on_the_loop(self, tmp_path: Path) -> None:
        """Every call at work waits in the batch: the loop commits it itself."""
        in_progress = 2
        store = SqliteStore(tmp_path / "gw.db", instance="one", active_calls=lambda: in_progress)
        await store.open()
        commits = commit_threads(store)
        try:
            await asyncio.gather(store.admit(call(1, key="a")), store.admit(call(1, key="b")))
            assert commits == [threading.current_thread().name]
            in_progress = 3  # a third call is elsewhere (reading its body, at its tool)
            await asyncio.gather(store.admit(call(1, key="c")), store.admit(call(1, key="d")))
            assert commits[1].startswith("sqlite-writer")
        finally:
            await store.close()

    async def test_a_batch_of_other_work_commits_in_the_writer_while_a_call_is_at_work(
        self, tmp_path: Path
    ) -> None:
        """A heartbeat while the one call at work waits at its tool: the batch holds every
        operation there is, but not the call, whose deadline the loop must keep. Beside the
        call's own operation, it is committed on the loop as the call's batch."""
        store = SqliteStore(tmp_path / "gw.db", instance="one", active_calls=lambda: 1)
        await store.open()
        commits = commit_threads(store)
        try:
            await store.heartbeat()
            await store.admit(call(1, key="a"))  # the call's own: on the loop, as before
            assert commits[0].startswith("sqlite-writer")
            assert commits[1] == threading.current_thread().name
            await asyncio.gather(store.heartbeat(), store.admit(call(1, key="b")))
            assert commits[2] == threading.current_thread().name  # the call waits in it
        finally:
            await store.close()

    async def test_bulk_operations_and_bare_stores_commit_in_the_writer(
        self, tmp_path: Path
    ) -> None:
        alone = SqliteStore(tmp_path / "a.db", instance="one", active_calls=lambda: 0)
        bare = SqliteStore(tmp_path / "b.db", instance="two")  # no count: never on the loop
        for store in (alone, bare):
            await store.open()
        commits = {store: commit_threads(store) for store in (alone, bare)}
        try:
            await alone.committer.submit(lambda conn: None, bulk=True)
            await bare.admit(call(1, key="a"))
            for seen in commits.values():
                assert len(seen) == 1 and seen[0].startswith("sqlite-writer")
        finally:
            for store in (alone, bare):
                await store.close()

    async def test_the_upkeep_after_a_batch_committed_on_the_loop_runs_in_the_writer(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A due checkpoint holds up the next batch, not the loop; the next batch waits for
        it and commits as before."""
        monkeypatch.setattr(sqlite_module, "CHECKPOINT_AFTER_CHANGES", 1)
        store = SqliteStore(tmp_path / "gw.db", instance="one", active_calls=lambda: 1)
        await store.open()
        threads: dict[str, list[str]] = {"COMMIT": [], "checkpoint": []}

        def on_statement(statement: str) -> None:
            kind = "checkpoint" if "wal_checkpoint" in statement else statement
            threads.get(kind, []).append(threading.current_thread().name)

        store._writer_conn.set_trace_callback(on_statement)
        try:
            first = await store.admit(call(1, key="a"))
            second = await store.admit(call(1, key="b"))
            assert threads["COMMIT"] == [threading.current_thread().name] * 2
            assert threads["checkpoint"] and all(
                name.startswith("sqlite-writer") for name in threads["checkpoint"]
            )
            for admitted in (first, second):
                assert isinstance(admitted, Admitted)
                assert (await store.get_receipt(admitted.receipt_id)).status == "pending"
        finally:
            await store.close()

    @pytest.mark.parametrize(("upkeep_due", "hand_backs"), [(False, 1), (True, 2)])
    async def test_the_writer_hands_a_batch_back_once_unless_upkeep_is_due(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        upkeep_due: bool,
        hand_backs: int,
    ) -> None:
        """Each hand-back to the loop is a wake-up: the answers and the connection go back
        together, and apart only when a checkpoint between them would hold up the answers."""
        if upkeep_due:
            monkeypatch.setattr(sqlite_module, "CHECKPOINT_AFTER_CHANGES", 1)
        store = SqliteStore(tmp_path / "gw.db", instance="one")  # commits in the writer
        await store.open()
        loop = asyncio.get_running_loop()
        handed: list[str] = []
        real = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
            if threading.current_thread() is not threading.main_thread():
                handed.append(callback.__name__)
            return real(callback, *args, **kwargs)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
        try:
            admitted = await store.admit(call(1, key="a"))
            await asyncio.sleep(0.05)  # the connection's hand-back, when it comes apart
            assert len(handed) == hand_backs, handed
            assert (await store.get_receipt(admitted.receipt_id)).status == "pending"
        finally:
            await store.close()

    async def test_closing_answers_every_operation(self, tmp_path: Path) -> None:
        """The batch the writer has is committed; what waits for the next one is refused."""
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()
        first = [asyncio.ensure_future(store.admit(call(1, key=f"a{i}"))) for i in range(10)]
        await asyncio.sleep(0)  # submitted
        await asyncio.sleep(0)  # begun, and handed to the writer
        later = [asyncio.ensure_future(store.admit(call(1, key=f"b{i}"))) for i in range(10)]
        await asyncio.sleep(0)  # submitted, waiting for the next batch
        await store.close()
        assert {type(r).__name__ for r in await asyncio.gather(*first)} == {"Admitted"}
        refused = await asyncio.gather(*later, return_exceptions=True)
        assert all(isinstance(r, StoreUnavailable) for r in refused)
        with pytest.raises(StoreUnavailable):
            await store.admit(call(1, key="late"))


def commit_threads(store: SqliteStore) -> list[str]:
    """The thread of every COMMIT the store's writer connection runs from now on (also for
    tests/e2e/test_operations.py)."""
    seen: list[str] = []

    def on_statement(statement: str) -> None:
        if statement == "COMMIT":
            seen.append(threading.current_thread().name)

    store._writer_conn.set_trace_callback(on_statement)
    return seen


def _statements(store: SqliteStore) -> list[str]:
    """Every statement the writer connection runs from now on, as it runs it."""
    seen: list[str] = []
    store._writer_conn.set_trace_callback(seen.append)
    return seen


def _writes(seen: list[str]) -> list[str]:
    """The statements of operations: not the group commit's own BEGIN and COMMIT."""
    return [s for s in seen if s not in ("BEGIN IMMEDIATE", "COMMIT")]


class TestWriterWork:
    """What a call runs on the writer connection: few statements, and no checkpoint in a
    commit."""

    async def test_a_new_call_is_one_read_and_one_write_then_one_update(
        self, tmp_path: Path
    ) -> None:
        """The key is its receipt's (schema 8): neither the admission nor the outcome writes
        a row of its own for it."""
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()
        try:
            await store.admit(call(1, key="first"))  # the resource's fence row is written
            seen = _statements(store)
            admitted = await store.admit(call(1, key="second"))
            assert [s.split()[0] for s in _writes(seen)] == ["SELECT", "INSERT"]
            seen.clear()
            assert await store.complete(admitted.receipt_id, ok()) == "recorded"
            assert [s.split()[0] for s in _writes(seen)] == ["UPDATE"]
            seen.clear()
            await store.admit(call(2, key="third"))  # a higher fence: the row advances
            assert [s.split()[0] for s in _writes(seen)] == ["SELECT", "INSERT", "INSERT"]
        finally:
            await store.close()

    async def test_the_wal_is_checkpointed_between_batches_and_stays_bounded(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(sqlite_module, "CHECKPOINT_AFTER_CHANGES", 50)
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()
        try:
            conn = store._writer_conn
            assert conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
            assert conn.execute("PRAGMA cache_size").fetchone()[0] == -64 * 1024
            seen = _statements(store)
            wal = tmp_path / "gw.db-wal"
            sizes = []
            for i in range(60):
                await asyncio.gather(
                    *(store.admit(call(1, key=f"k{i}-{j}", resource=f"r/{j}")) for j in range(20))
                )
                sizes.append(wal.stat().st_size)
            checkpoints = [s for s in seen if s.startswith("PRAGMA wal_checkpoint")]
            assert checkpoints, "no checkpoint ran"
            for n, statement in enumerate(seen):  # never inside a transaction
                if statement.startswith("PRAGMA wal_checkpoint"):
                    assert seen[n - 1] == "COMMIT", seen[n - 2 : n + 1]
            # each checkpoint folds every frame back, so the WAL restarts from its beginning:
            # it holds what about 50 rows dirty, not the 60 batches' 10 MiB and more
            assert max(sizes) < 2 * 1024 * 1024, sizes[-5:]
        finally:
            await store.close()

    async def test_retention_deletes_in_small_batches(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(sqlite_module, "PRUNE_BATCH", 2)
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()
        try:
            for i in range(5):
                rejection = call(1, key=f"r{i}").rejection(None, "stale_fence")
                await store.reject(rejection)
            seen = _statements(store)
            assert await store.prune(0) == 5
            deletes = [s for s in seen if s.startswith("DELETE FROM receipts")]
            assert len(deletes) == 3  # 2, 2, then 1: fewer than a batch, so the last
            assert all(s.endswith("LIMIT 2)") for s in deletes)
            assert seen.count("COMMIT") >= 3  # each batch its own write
        finally:
            await store.close()


def _plan(conn: sqlite3.Connection, statement: str) -> list[str]:
    return [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {statement}")]


class TestIndexes:
    """Each index a call writes is one a query searches; none of those queries scans."""

    async def test_a_call_and_retention_search_by_index(self, tmp_path: Path) -> None:
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()
        try:
            seen = _statements(store)
            admitted = await store.admit(call(1, key="a"))
            await store.complete(admitted.receipt_id, ok())
            await store.reject(call(1, key="b").rejection(None, "stale_fence"))
            await store.prune(0)
            await store.expire_pending(NO_WAIT, 0, frozenset())
            statements = [s for s in _writes(seen) if not s.startswith("PRAGMA")]
            assert {s.split()[0] for s in statements} == {"SELECT", "INSERT", "UPDATE", "DELETE"}
            with sqlite3.connect(tmp_path / "gw.db") as conn:
                for statement in statements:
                    scans = [
                        step
                        for step in _plan(conn, statement)
                        # the admission read's constant row and the (tiny) glob raises
                        if step.startswith("SCAN") and step not in ("SCAN CONSTANT ROW",
                                                                    "SCAN one",
                                                                    "SCAN fence_raises")
                    ]  # fmt: skip
                    assert not scans, (statement, scans)
                plans = " ".join(" ".join(_plan(conn, s)) for s in statements)
                # retention: each settled status's receipts up to the cutoff's (schema 9)
                assert "receipts_by_status (status=? AND id<?)" in plans
        finally:
            await store.close()

    async def test_reopening_keeps_the_indexes_of_the_newest_schema(self, tmp_path: Path) -> None:
        for instance in ("one", "two"):  # the second open must not make the old ones again
            store = SqliteStore(tmp_path / "gw.db", instance=instance)
            await store.open()
            await store.close()
        with sqlite3.connect(tmp_path / "gw.db") as conn:
            indexes = dict(
                conn.execute(
                    "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
                ).fetchall()
            )
        assert "keys_by_receipt" not in indexes and "keys_by_expiry" not in indexes
        # schema 9: none that only an outcome writes, for retention's sake
        assert "receipts_by_key_expiry" not in indexes
        assert "receipts_by_completion" not in indexes
