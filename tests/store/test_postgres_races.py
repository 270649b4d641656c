"""Races between replicas on one PostgreSQL store: an outcome batch and a peer's sweep, a
replay and a peer's retention, an instance id and its restart. Each interleaving is made
deterministic by holding a lock (or pausing a statement) on another connection, as
tests/store/test_postgres.py::TestInstances does (docs/contract.md §3, §4, §9, §14)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.core.errors import StoreUnavailable
from gateway.core.receipts import ReconcileWaits
from gateway.store import create_store
from gateway.store.base import Admitted, Completion
from tests.store.conftest import make_store, pg_database
from tests.store.test_contract import call, ok

asyncpg = pytest.importorskip("asyncpg")

from gateway.store.postgres import _ADVANCE_AND_REPLAY, PostgresStore  # noqa: E402
from tests.store.test_postgres_admission import (  # noqa: E402
    LOCK_WAITS,
    RESOURCE,
    until,
)


async def two_replicas(tmp_path: Path) -> tuple[PostgresStore, PostgresStore]:
    one = make_store("postgres", tmp_path, instance="replica-0")
    two = make_store("postgres", tmp_path, instance="replica-1")
    assert isinstance(one, PostgresStore) and isinstance(two, PostgresStore)
    await one.open()
    await two.open()
    return one, two


async def beating(store: Any, seconds: float) -> None:
    """Let `seconds` pass while `store` keeps its heartbeat."""
    for _ in range(round(seconds / 0.1)):
        await store.heartbeat()
        await asyncio.sleep(0.1)
    await store.heartbeat()


class TestOutcomeBatchAgainstASweep:
    async def test_an_outcome_batch_and_a_peer_s_sweep_do_not_deadlock(
        self, tmp_path: Path
    ) -> None:
        """Both lock receipts in the order of their ids: the outcomes arriving b first no
        longer make the batch hold b while the sweep holds a, each waiting for the other
        (PostgreSQL then aborted one of them: the sweep's whole pass failed)."""
        owner, peer = await two_replicas(tmp_path)
        blocker = await asyncpg.connect(pg_database(tmp_path))
        watcher = await asyncpg.connect(pg_database(tmp_path))
        try:
            a = await owner.admit(call(1, key="a"))
            b = await owner.admit(call(1, key="b"))
            assert isinstance(a, Admitted) and isinstance(b, Admitted)
            assert a.receipt_id < b.receipt_id
            # Hold b's key, so that the batch stops between its receipts: b's receipt locked,
            # a's not yet.
            await blocker.execute("BEGIN")
            await blocker.execute(
                "SELECT 1 FROM idempotency_keys WHERE resource = $1 AND key = 'b' FOR UPDATE",
                RESOURCE,
            )
            recording = asyncio.ensure_future(
                asyncio.gather(
                    owner.complete(b.receipt_id, ok()),  # the outcomes arrive b first
                    owner.complete(a.receipt_id, ok()),
                    return_exceptions=True,
                )
            )
            await until(watcher, LOCK_WAITS, lambda n: n == 1, "the batch never waited")
            # A peer's sweeper: both calls are past their upstream's timeout + grace.
            sweep = asyncio.ensure_future(
                peer.expire_pending(ReconcileWaits({}, default=0), 3600.0, frozenset())
            )
            await until(watcher, LOCK_WAITS, lambda n: n == 2, "the sweep never waited")
            await blocker.execute("COMMIT")
            try:
                swept = await asyncio.wait_for(sweep, 15)
            except StoreUnavailable as exc:
                pytest.fail(f"the sweep lost a deadlock against the outcome batch: {exc}")
            answers = await asyncio.wait_for(recording, 15)
            assert all(isinstance(x, Completion) for x in answers), answers
            assert sum(swept.values()) + answers.count(Completion.RECORDED) >= 2
        finally:
            await watcher.close()
            await blocker.close()
            await owner.close()
            await peer.close()


class TestInstancesAgainstRetention:
    async def test_a_lapsed_instance_s_id_is_neither_taken_again_nor_renewed(
        self, tmp_path: Path
    ) -> None:
        """Retention keeps every instance's row (docs/contract.md §9: an id is never taken
        twice). With the row of a lapsed instance deleted, a restart under the same
        GATEWAY_INSTANCE_ID took the id again, and the lapsed process, waking, renewed the
        new row's heartbeat: it could forward again (§14)."""
        url = pg_database(tmp_path)

        def opened_as(name: str) -> Any:
            return create_store(url, instance=name, durability="strict", heartbeat_interval_s=0.2)

        old, peer = opened_as("x"), opened_as("peer")
        await old.open()
        await peer.open()
        restarted = None
        try:
            admitted = await old.admit(call(1))
            assert isinstance(admitted, Admitted) and admitted.instance == "x"
            await beating(peer, 0.8)  # "x" paused: lapsed by its clock, silent by the database's
            swept = await peer.expire_pending(ReconcileWaits({}, default=3600), 0.6, frozenset())
            assert swept == {"tool": 1}
            await beating(peer, 0.6)
            await peer.prune(1.0)  # a receipt retention shorter than the pause
            direct = await asyncpg.connect(url)
            try:
                left = await direct.fetch("SELECT id FROM instances ORDER BY id")
            finally:
                await direct.close()
            assert [row["id"] for row in left] == ["peer", "x"]
            restarted = opened_as("x")  # the same GATEWAY_INSTANCE_ID, restarted
            await restarted.open()
            assert restarted.instance != "x"
            await old.heartbeat()  # the paused process wakes up
            assert not old.may_forward(admitted.instance)
        finally:
            await old.close()
            await peer.close()
            if restarted is not None:
                await restarted.close()


class TestReplayAgainstPrune:
    async def test_a_replay_whose_key_a_peer_prunes_meanwhile_is_answered(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The full admission reads the key's state (`_ADMIT_READ`) and the stored answer in a
        later statement (`_ADVANCE_AND_REPLAY`), and `prune` takes no lock of the resource's:
        a key that expires in between, pruned with its receipt, leaves the replay with no row.
        The admission decides again on what is there."""
        gate, reached = asyncio.Event(), asyncio.Event()
        fetchrow = asyncpg.Connection.fetchrow

        async def paused(self: Any, query: str, *args: Any, **kw: Any) -> Any:
            if query == _ADVANCE_AND_REPLAY:
                reached.set()
                await gate.wait()
            return await fetchrow(self, query, *args, **kw)

        monkeypatch.setattr(asyncpg.Connection, "fetchrow", paused)
        store, peer = await two_replicas(tmp_path)
        direct = await asyncpg.connect(pg_database(tmp_path))
        try:
            first = await store.admit(call(1, key="k"))
            assert isinstance(first, Admitted)
            await store.complete(first.receipt_id, ok())
            # The receipt is past the receipt retention; the key expires in a second, after
            # the admission has read it (a second's margin for a slow machine).
            await direct.execute(
                "UPDATE receipts SET created_at = created_at - 700000, "
                "completed_at = completed_at - 700000"
            )
            await direct.execute(
                "UPDATE idempotency_keys SET expires_at = extract(epoch from clock_timestamp()) + 1"
            )
            replaying = asyncio.create_task(store.admit(call(2, key="k")))
            await asyncio.wait_for(reached.wait(), 10)  # it read the key, still kept
            await asyncio.sleep(1.1)
            assert await peer.prune(604800.0) == 1  # the peer's sweeper, meanwhile
            gate.set()
            try:
                answer = await asyncio.wait_for(replaying, 10)
            except TypeError as exc:
                pytest.fail(f"the admission failed on the pruned answer: {exc!r}")
            assert isinstance(answer, Admitted) and answer.attempt == 1, answer  # a new call
        finally:
            gate.set()
            await direct.close()
            await store.close()
            await peer.close()
