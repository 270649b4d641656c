"""What only the PostgreSQL backend does: a schema shared by replicas, checks made by the
database across several stores (replicas) on one database (docs/contract.md §14)."""

import asyncio
import random
from pathlib import Path

import pytest

from gateway.core.errors import StoreUnavailable
from gateway.store import create_store
from gateway.store.base import Admitted, Refused
from tests.store.conftest import make_store, pg_database
from tests.store.test_contract import call, ok

asyncpg = pytest.importorskip("asyncpg")

from gateway.store.postgres import (  # noqa: E402
    SCHEMA_VERSION,
    PostgresStartupError,
    PostgresStore,
)


async def sql(tmp_path: Path, statement: str, *args: object) -> list:
    conn = await asyncpg.connect(pg_database(tmp_path))
    try:
        return await conn.fetch(statement, *args)
    finally:
        await conn.close()


async def replicas(tmp_path: Path, n: int = 2) -> list[PostgresStore]:
    stores = [make_store("postgres", tmp_path, instance=f"replica-{i}") for i in range(n)]
    await asyncio.gather(*(store.open() for store in stores))
    return stores


async def close(stores: list[PostgresStore]) -> None:
    await asyncio.gather(*(store.close() for store in stores))


class TestSchema:
    async def test_two_replicas_starting_together_migrate_once(self, tmp_path: Path) -> None:
        stores = await replicas(tmp_path, 4)
        try:
            rows = await sql(tmp_path, "SELECT version FROM schema_version")
            assert [row["version"] for row in rows] == list(range(1, SCHEMA_VERSION + 1))
            instances = await sql(tmp_path, "SELECT id FROM instances ORDER BY id")
            assert [row["id"] for row in instances] == [f"replica-{i}" for i in range(4)]
            assert isinstance(await stores[0].admit(call(1)), Admitted)
        finally:
            await close(stores)

    async def test_a_newer_schema_is_refused(self, tmp_path: Path) -> None:
        [store] = await replicas(tmp_path, 1)
        await store.close()
        await sql(tmp_path, "INSERT INTO schema_version VALUES ($1, 0)", SCHEMA_VERSION + 1)
        newer = make_store("postgres", tmp_path)
        with pytest.raises(PostgresStartupError, match="newer than this gateway knows") as exc:
            await newer.open()
        assert "\n" not in str(exc.value)


class TestDurability:
    async def test_strict_refuses_synchronous_commit_off(self, tmp_path: Path) -> None:
        url = pg_database(tmp_path)
        name = url.rsplit("/", 1)[1]
        await sql(tmp_path, f"ALTER DATABASE {name} SET synchronous_commit = off")
        with pytest.raises(PostgresStartupError, match="synchronous_commit") as exc:
            await make_store("postgres", tmp_path).open()
        assert "\n" not in str(exc.value)
        relaxed = create_store(url, instance="relaxed", durability="relaxed")
        await relaxed.open()  # relaxed durability does not ask for it
        try:
            admitted = await relaxed.admit(call(1))
            assert await relaxed.complete(admitted.receipt_id, ok()) == "recorded"
            assert (await relaxed.acquire("r/1", "a", 30, 0, None, None)).result == "acquired"
        finally:
            await relaxed.close()

    async def test_a_failing_commit_writes_nothing(self, tmp_path: Path) -> None:
        failing = {"on": False}

        def before_commit() -> None:
            if failing["on"]:
                raise RuntimeError("failpoint in_commit")

        store = create_store(
            pg_database(tmp_path), instance="one", durability="strict", before_commit=before_commit
        )
        await store.open()
        try:
            failing["on"] = True
            with pytest.raises(StoreUnavailable):
                await store.admit(call(5))
            failing["on"] = False
            assert isinstance(await store.admit(call(1)), Admitted)  # 5 was never accepted
        finally:
            await store.close()

    async def test_an_unreachable_server_is_store_unavailable(self) -> None:
        store = create_store(
            "postgresql://postgres@127.0.0.1:1/none", instance="x", durability="strict"
        )
        assert isinstance(store, PostgresStore)
        with pytest.raises(StoreUnavailable, match="cannot connect"):
            await store.open()


class TestReplicas:
    """Two stores, two pools: two replicas on one database."""

    async def test_concurrent_acquires_over_two_replicas_give_one_owner(self, tmp_path: Path):
        stores = await replicas(tmp_path)
        try:
            results = await asyncio.gather(
                *(stores[i % 2].acquire("r/1", f"w{i}", 30, 0, None, None) for i in range(30))
            )
            assert [r.result for r in results].count("acquired") == 1
            fences = {r.lease.fence for r in results}
            assert fences == {1}
        finally:
            await close(stores)

    async def test_concurrent_admissions_never_accept_below_an_accepted_fence(
        self, tmp_path: Path
    ) -> None:
        stores = await replicas(tmp_path)
        try:
            fences = list(range(1, 101))
            random.Random(11).shuffle(fences)
            results = await asyncio.gather(
                *(stores[f % 2].admit(call(f, key=f"k{f}")) for f in fences)
            )
            # The database's clock is read after the resource's lock is taken, so
            # `created_at` orders the admissions of one resource across replicas.
            receipts = [await stores[0].get_receipt(r.receipt_id) for r in results]
            in_lock_order = sorted(
                (rc.created_at, f, isinstance(r, Admitted))
                for rc, r, f in zip(receipts, results, fences, strict=True)
            )
            highest = 0
            for _, fence, admitted in in_lock_order:
                assert admitted == (fence >= highest), (fence, highest)
                highest = max(highest, fence) if admitted else highest
            assert all(isinstance(r, Admitted | Refused) for r in results)
            assert {r.code for r in results if isinstance(r, Refused)} <= {"stale_fence"}
            [row] = await sql(tmp_path, "SELECT accepted FROM fences WHERE resource = 'acct/1'")
            assert row["accepted"] == highest
        finally:
            await close(stores)

    async def test_identical_calls_over_two_replicas_admit_once(self, tmp_path: Path) -> None:
        stores = await replicas(tmp_path)
        try:
            results = await asyncio.gather(*(stores[i % 2].admit(call(1)) for i in range(20)))
            assert sum(isinstance(r, Admitted) for r in results) == 1
        finally:
            await close(stores)

    async def test_an_expired_lease_is_cleaned_up_once(self, tmp_path: Path) -> None:
        stores = await replicas(tmp_path)
        try:
            await stores[0].acquire("r/1", "run-a", 0.05, 0, None, None)
            await asyncio.sleep(0.1)
            expired = await asyncio.gather(*(s.expire_leases(lambda r, o: 0.0) for s in stores))
            assert sorted(len(e) for e in expired) == [0, 1]  # marked by one sweeper
            assert [c.lease_fence for c in await stores[1].list_cleanups()] == [1]
            claims = await asyncio.gather(
                *(
                    stores[i % 2].claim_cleanup("r/1", f"gateway-sweeper:{i}", 30, 0, 5)
                    for i in range(10)
                )
            )
            assert [c.state for c in claims].count("claimed") == 1
            claimed = next(c for c in claims if c.state == "claimed")
            assert (claimed.fence, claimed.key) == (2, "gw-sweep-2")
        finally:
            await close(stores)

    async def test_pending_receipts_survive_a_peer_starting(self, tmp_path: Path) -> None:
        """Several replicas share the database: a start turns nothing unknown."""
        [first] = await replicas(tmp_path, 1)
        try:
            admitted = await first.admit(call(1))
            second = make_store("postgres", tmp_path, instance="replica-late")
            await second.open()
            try:
                assert second.recovered == {}
                assert (await second.get_receipt(admitted.receipt_id)).status == "pending"
            finally:
                await second.close()
        finally:
            await first.close()
