"""What only the PostgreSQL backend does: a schema shared by replicas, checks made by the
database across several stores (replicas) on one database (docs/contract.md §14)."""

import asyncio
import random
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.core.errors import StoreUnavailable
from gateway.core.receipts import ReconcileWaits
from gateway.store import create_store
from gateway.store.base import Admitted, Refused
from tests.store.conftest import make_store, pg_database
from tests.store.test_contract import call, ok

asyncpg = pytest.importorskip("asyncpg")

from gateway.store.postgres import (  # noqa: E402
    _HEARTBEAT,
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


async def heartbeating(tmp_path: Path, interval_s: float, *names: str) -> list[PostgresStore]:
    """Open stores whose leases are `interval_s` sweep intervals (silent after three); their
    heartbeats are the test's to send."""
    stores = [
        create_store(
            pg_database(tmp_path),
            instance=name,
            durability="strict",
            heartbeat_interval_s=interval_s,
        )
        for name in names
    ]
    for store in stores:
        await store.open()
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

    async def test_a_server_without_autovacuum_is_warned_of(self, tmp_path: Path) -> None:
        # A server-wide setting (it cannot be set for one database): the warning is asked of
        # whichever way this server has it.
        [[autovacuum]] = await sql(tmp_path, "SHOW autovacuum")
        store = make_store("postgres", tmp_path)
        await store.open()
        await store.close()
        events = [event for event, _ in store.open_warnings]
        assert events == (["postgres_autovacuum_off"] if autovacuum == "off" else [])
        assert all("vacuumed" in detail for _, detail in store.open_warnings)

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
            "postgresql://postgres@127.0.0.1:1/none",
            instance="x",
            durability="strict",
            start_timeout_s=0,  # one try of each host (a replica tries for a minute)
        )
        assert isinstance(store, PostgresStore)
        with pytest.raises(StoreUnavailable, match=r"cannot connect.*127\.0\.0\.1:1: "):
            await store.open()


class TestEpochs:
    """docs/contract.md §19 on one server: its epoch never changes under load."""

    async def test_new_connections_racing_heartbeats_never_see_the_wal_go_back(
        self, tmp_path: Path
    ) -> None:
        stores = await replicas(tmp_path)
        try:

            async def beat() -> None:
                for _ in range(40):
                    await asyncio.gather(*(s.heartbeat() for s in stores))

            # Many admissions at once make each pool open new connections, whose WAL
            # positions are read while the heartbeats read newer ones.
            await asyncio.gather(
                beat(),
                *(stores[i % 2].admit(call(1, resource=f"r/{i}")) for i in range(60)),
            )
            assert [s.drain_epoch_changes() for s in stores] == [[], []]
            rows = await sql(tmp_path, "SELECT reason FROM store_epochs")
            assert [row["reason"] for row in rows] == ["first epoch"]
        finally:
            await close(stores)


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


class TestCallsInFlightOnAnyReplica:
    """Admission tells a replica whether calls that must go first are pending elsewhere."""

    async def test_a_newer_fence_waits_for_an_older_pending_one_on_a_peer(
        self, tmp_path: Path
    ) -> None:
        a, b = await replicas(tmp_path)
        try:
            older = await a.admit(call(1, key="old"))
            same = await b.admit(call(1, key="same"))
            newer = await b.admit(call(2, key="new"))
            assert isinstance(older, Admitted) and not older.ahead
            assert isinstance(same, Admitted) and not same.ahead  # an equal fence runs beside
            assert isinstance(newer, Admitted) and newer.ahead
            assert await b.pending_ahead("acct/1", 2, newer.turn)
            await a.complete(older.receipt_id, ok())
            assert await b.pending_ahead("acct/1", 2, newer.turn)  # fence 1 of `same` is left
            await b.complete(same.receipt_id, ok())
            assert not await b.pending_ahead("acct/1", 2, newer.turn)
        finally:
            await close([a, b])

    async def test_serial_calls_take_turns_across_replicas(self, tmp_path: Path) -> None:
        a, b = await replicas(tmp_path)
        serial = dict(resource="s/1", fp="sha256:s")
        try:
            first = await a.admit(replace(call(3, key="1", **serial), serial=True))
            second = await b.admit(replace(call(3, key="2", **serial), serial=True))
            beside = await b.admit(call(3, key="3", **serial))  # a parallel rule's call
            assert isinstance(first, Admitted) and (first.turn, first.ahead) == (1, False)
            assert isinstance(second, Admitted) and (second.turn, second.ahead) == (2, True)
            assert isinstance(beside, Admitted) and (beside.turn, beside.ahead) == (None, False)
            await a.complete(first.receipt_id, ok())
            assert not await b.pending_ahead("s/1", 3, second.turn)
        finally:
            await close([a, b])


class TestInstances:
    async def test_an_instance_id_is_never_taken_twice(self, tmp_path: Path) -> None:
        stores = [make_store("postgres", tmp_path, instance="same") for _ in range(3)]
        for store in stores:
            await store.open()
        assert [store.instance for store in stores] == ["same", "same.1", "same.2"]
        await close(stores)
        again = make_store("postgres", tmp_path, instance="same")
        await again.open()
        assert again.instance == "same.3"  # a silent id stays dead: it may be being recovered
        await again.close()

    async def test_a_lapsed_instance_forwards_nothing_and_goes_on_under_a_new_id(
        self, tmp_path: Path
    ) -> None:
        # Lapsed after two intervals by its own clock; refused by the database after three.
        store = create_store(
            pg_database(tmp_path), instance="r", durability="strict", heartbeat_interval_s=1.0
        )
        await store.open()
        try:
            admitted = await store.admit(call(1))
            assert isinstance(admitted, Admitted) and admitted.instance == "r"
            assert store.may_forward("r")
            await asyncio.sleep(2.2)
            assert not store.may_forward("r")  # lapsed: nothing leaves …
            await store.heartbeat()
            assert (store.instance, store.may_forward("r")) == ("r", True)  # … until renewed
            await asyncio.sleep(3.2)
            await store.heartbeat()  # silent too long: the database refuses the old id
            assert store.instance == "r.1"
            assert (store.may_forward("r"), store.may_forward("r.1")) == (False, True)
            # The old id's call is never forwarded; its receipt waits for the sweeper.
            assert (await store.get_receipt(admitted.receipt_id)).status == "pending"
        finally:
            await store.close()

    async def test_a_renewal_committing_as_a_peer_sweeps_keeps_the_instance_s_calls(
        self, tmp_path: Path
    ) -> None:
        """A heartbeat the database accepted, still committing when a peer's sweeper looked:
        the sweeper saw the instance silent, but the instance is renewed and forwards its
        calls again. Recovering them then would let a newer call overtake one still to leave
        (docs/contract.md §14, "A replica fences itself"): the sweeper waits for the renewal
        and leaves them pending."""
        a, b = await heartbeating(tmp_path, 0.5, "a", "b")
        renewal = await asyncpg.connect(pg_database(tmp_path))
        try:
            admitted = await a.admit(call(1))
            assert isinstance(admitted, Admitted)
            silent_after_s = 1.5
            await asyncio.sleep(1.0)
            # a's heartbeat, as the database runs it, accepted and not yet committed …
            tx = renewal.transaction()
            await tx.start()
            renewed = await renewal.fetchrow(_HEARTBEAT, "a", silent_after_s)
            assert renewed is not None and renewed["id"] == "a"
            await asyncio.sleep(0.7)  # … while, by the last committed heartbeat, a is silent
            sweep = asyncio.create_task(
                b.expire_pending(ReconcileWaits({}, default=3600), silent_after_s, frozenset())
            )
            await asyncio.sleep(0.2)
            assert not sweep.done()  # it waits for the renewal to commit or not
            await tx.commit()
            assert await sweep == {}
            assert (await b.get_receipt(admitted.receipt_id)).status == "pending"
        finally:
            await renewal.close()
            await close([a, b])

    async def test_a_sweep_that_recovers_an_instance_s_calls_ends_its_heartbeat(
        self, tmp_path: Path
    ) -> None:
        # The other order: once a peer has recovered the calls, no renewal of the id can pass,
        # whatever time the database's clock gave it, and the instance goes on under a new id.
        a, b = await heartbeating(tmp_path, 0.2, "a", "b")
        try:
            admitted = await a.admit(call(1))
            await asyncio.sleep(0.7)
            [[before]] = await sql(tmp_path, "SELECT heartbeat_at FROM instances WHERE id = 'a'")
            assert await b.expire_pending(ReconcileWaits({}, default=3600), 0.6, frozenset()) == {
                "tool": 1
            }
            # ended: set back a whole lease, beyond any renewal whatever clock it read
            [[after]] = await sql(tmp_path, "SELECT heartbeat_at FROM instances WHERE id = 'a'")
            assert after - before == pytest.approx(-0.6)
            assert (await b.get_receipt(admitted.receipt_id)).status == "outcome_unknown"
            await a.heartbeat()
            assert a.instance == "a.1"
        finally:
            await close([a, b])


class TestAConnectionLostUnderAnOutcome:
    """A killed connection leaves a write's fate unknown to the replica; recording an outcome
    is safe to ask again (a receipt takes one outcome), so it is asked once more on a fresh
    connection instead of leaving the call `outcome_unknown`."""

    @pytest.mark.parametrize("cut", ["the writer's connection", "every connection"])
    async def test_the_outcome_is_written_on_a_fresh_connection(
        self, tmp_path: Path, cut: str
    ) -> None:
        [store] = await replicas(tmp_path, 1)
        blocker = await asyncpg.connect(pg_database(tmp_path))
        try:
            # Several idle connections in the pool: a failover cuts them all.
            await asyncio.gather(*(store.get_receipt("none") for _ in range(4)))
            admitted = await store.admit(call(1))
            assert isinstance(admitted, Admitted)
            # Hold the receipt's row so that the outcome's statement waits on it, then kill
            # the backend that waits (and, in a failover, its idle peers too): the statement
            # dies in flight.
            await blocker.execute("BEGIN")
            await blocker.execute(
                "SELECT 1 FROM receipts WHERE id = $1 FOR UPDATE", admitted.receipt_id
            )
            writing = asyncio.create_task(store.complete(admitted.receipt_id, ok()))
            waiting = None
            for _ in range(500):
                waiting = await blocker.fetchval(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"
                )
                if waiting is not None:
                    break
                await asyncio.sleep(0.01)
            assert waiting is not None, "the outcome's statement never waited on the row"
            victims = (
                "SELECT $1::int"
                if cut == "the writer's connection"
                else "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND $1::int > 0"
            )
            killed = await blocker.fetch(
                f"SELECT pg_terminate_backend(pid) FROM ({victims}) AS v(pid)", waiting
            )
            assert killed and all(row[0] for row in killed)
            await asyncio.sleep(0.2)  # the write is asked again, and waits on the row again
            await blocker.execute("ROLLBACK")
            assert await asyncio.wait_for(writing, 10) == "recorded"
            assert (await store.get_receipt(admitted.receipt_id)).status == "succeeded"
        finally:
            await blocker.close()
            await store.close()
