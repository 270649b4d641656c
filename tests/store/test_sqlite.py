"""What only the SQLite backend does: the one-process lock, recovery at start, group commit."""

import asyncio
import os
from pathlib import Path

import pytest

from gateway.store.sqlite import SqliteStore, StoreLocked
from tests.store.test_contract import call


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
