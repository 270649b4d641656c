"""Receipt lists on PostgreSQL: a page's end never skips a receipt whose admission commits
after a later one's (docs/contract.md §7), on the real server, each interleaving held in
place by a transaction left open on another connection."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.store.base import Admitted, ReceiptQuery
from tests.pg import create_database, drop_database, url_of
from tests.store.conftest import pg_database
from tests.store.test_contract import call
from tests.store.test_postgres_admission import LOCK_WAITS, opened, until

asyncpg = pytest.importorskip("asyncpg")

from gateway.store import postgres_lists  # noqa: E402
from gateway.store.postgres import PostgresStore  # noqa: E402

EVERYTHING = 1000


async def listed_twice(store: PostgresStore, between: object) -> list[str]:
    """The ids of a first page of everything, then of the page after its end once `between`
    (an awaitable) is done: what a consumer following the list with its cursor sees."""
    first = await store.list_receipts(ReceiptQuery(limit=EVERYTHING))
    await between  # type: ignore[misc]
    rest = await store.list_receipts(ReceiptQuery(after=first.end, limit=EVERYTHING))
    return [r.id for r in first.items + rest.items]


async def every_id(store: PostgresStore) -> list[str]:
    return [r.id for r in (await store.list_receipts(ReceiptQuery(limit=EVERYTHING))).items]


class TestNoSkip:
    async def test_an_admission_with_an_older_id_that_commits_later_is_on_the_next_page(
        self, tmp_path: Path
    ) -> None:
        """The first admission's id is made, then it waits for its resource's lock; another
        resource's, with a later id, commits meanwhile; a page is read; then the first
        commits. Ordered by id, the next page would start past it."""
        store = await opened(tmp_path)
        holder = await asyncpg.connect(pg_database(tmp_path))
        try:
            assert isinstance(await store.admit(call(1, key="k1")), Admitted)
            await holder.execute("BEGIN")
            await holder.execute("SELECT 1 FROM fences WHERE resource = 'acct/1' FOR UPDATE")
            waiting = asyncio.create_task(store.admit(call(2, key="k2")))
            await until(holder, LOCK_WAITS, lambda n: n == 1, "the admission never waited")
            later = await store.admit(call(1, key="k3", resource="other/1"))
            assert isinstance(later, Admitted)

            async def release() -> None:
                await holder.execute("COMMIT")
                assert isinstance(await waiting, Admitted)

            seen = await listed_twice(store, release())
            assert sorted(seen) == sorted(await every_id(store)) and len(seen) == 3
        finally:
            await holder.close()
            await store.close()

    async def test_a_receipt_whose_transaction_is_still_open_holds_the_page_end_before_it(
        self, tmp_path: Path
    ) -> None:
        """A transaction of this database writes a receipt and stays open while a later
        admission commits: the list shows neither until it ends, then both, in order."""
        store = await opened(tmp_path)
        holder = await asyncpg.connect(pg_database(tmp_path))
        try:
            assert isinstance(await store.admit(call(1, key="k1")), Admitted)
            older_id = store._new_id()
            await holder.execute("BEGIN")
            await holder.execute(
                "INSERT INTO receipts (id, resource, fence, upstream, method, path, status, "
                "created_at, instance) VALUES ($1, 'slow/1', 1, 'tool', 'POST', '/x', "
                "'pending', 0, 'elsewhere')",
                older_id,
            )
            later = await store.admit(call(1, key="k2", resource="other/1"))
            assert isinstance(later, Admitted)
            assert len(await every_id(store)) == 1  # the tail waits for the open transaction
            seen = await listed_twice(store, holder.execute("COMMIT"))
            assert seen[1:] == [older_id, later.receipt_id]
        finally:
            await holder.close()
            await store.close()

    async def test_an_open_transaction_of_another_database_holds_nothing_back(
        self, tmp_path: Path
    ) -> None:
        store = await opened(tmp_path)
        name = create_database()
        elsewhere = await asyncpg.connect(url_of(name))
        try:
            await elsewhere.execute("BEGIN")
            await elsewhere.fetchval("SELECT pg_current_xact_id()")
            assert isinstance(await store.admit(call(1, key="k1")), Admitted)
            assert len(await every_id(store)) == 1
        finally:
            await elsewhere.close()
            await store.close()
            drop_database(name)


class TestPositions:
    def test_a_position_is_the_admitting_transaction_then_the_id(self) -> None:
        assert postgres_lists.after(postgres_lists.position(735, "01ABC")) == (735, "01ABC")

    @pytest.mark.parametrize("value", ["01ABC", "x.01ABC", "99999999999999999999.01ABC", "."])
    def test_any_other_position_is_a_lower_bound_before_every_new_receipt(self, value: str) -> None:
        assert postgres_lists.after(value) == (0, value)

    async def test_a_receipt_written_before_schema_12_sorts_first(self, tmp_path: Path) -> None:
        store = await opened(tmp_path)
        try:
            assert isinstance(await store.admit(call(1, key="k1")), Admitted)
            conn = await asyncpg.connect(pg_database(tmp_path))
            try:
                await conn.execute("UPDATE receipts SET admitted_by = '0'")
            finally:
                await conn.close()
            new = await store.admit(call(2, key="k2"))
            assert isinstance(new, Admitted)
            page = await store.list_receipts(ReceiptQuery(after="01", limit=EVERYTHING))
            assert [r.fence for r in page.items] == [1, 2]
        finally:
            await store.close()
