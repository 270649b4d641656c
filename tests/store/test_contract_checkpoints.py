"""The store contract for checkpoints and the run view (docs/contract.md §17), on every
backend: only the current owner appends, an identical retry appends nothing, a checkpoint
moves no fence, reads come newest first, retention keeps the last one."""

import asyncio
import json

import pytest

from gateway.core.checkpoints import NewCheckpoint, encoded_state
from gateway.store.base import Admitted, CheckpointRefused, CheckpointWritten, Outcome
from tests.harness import FakeClock
from tests.store.conftest import make_store
from tests.store.test_contract import call, ok

RESOURCE = "acct/1"


def new(
    fence: int,
    step: str = "step-1",
    state: object = None,
    *,
    owner: str | None = None,
    client: str | None = None,
    resource: str = RESOURCE,
    retention_s: float = 60,
) -> NewCheckpoint:
    return NewCheckpoint(
        resource=resource,
        fence=fence,
        owner=owner,
        client=client,
        step=step,
        state=encoded_state({"n": 1} if state is None else state),
        retention_s=retention_s,
    )


async def written(store, checkpoint: NewCheckpoint, issuer: str = "gateway", clients=False):
    result = await store.write_checkpoint(checkpoint, issuer, clients)
    assert isinstance(result, CheckpointWritten), result
    return result


async def refused(store, checkpoint: NewCheckpoint, issuer: str = "gateway", clients=False):
    result = await store.write_checkpoint(checkpoint, issuer, clients)
    assert isinstance(result, CheckpointRefused), result
    return result.code


class TestWriting:
    async def test_the_owner_appends_and_a_retry_appends_nothing(self, store) -> None:
        lease = (await store.acquire(RESOURCE, "run-a", 30, 0, None, None)).lease
        first = await written(store, new(lease.fence, state={"a": 1, "b": [1, 2]}))
        assert first.created
        assert first.checkpoint.seq == 1
        assert (first.checkpoint.owner, first.checkpoint.fence) == ("run-a", lease.fence)
        # the same state, keys in another order: an identical retry
        again = await written(store, new(lease.fence, state={"b": [1, 2], "a": 1}))
        assert not again.created and again.checkpoint == first.checkpoint
        second = await written(store, new(lease.fence, state={"a": 2}))
        assert second.created and second.checkpoint.seq == 2
        # the first step again is a new checkpoint: only the latest is a retry's
        third = await written(store, new(lease.fence, state={"a": 1, "b": [1, 2]}))
        assert third.created and third.checkpoint.seq == 3
        items = await store.list_checkpoints(RESOURCE, None, 10)
        assert [c.seq for c in items] == [3, 2, 1]
        assert json.loads(items[-1].state) == {"a": 1, "b": [1, 2]}

    async def test_a_taken_over_owner_is_refused_and_writes_nothing(self, store) -> None:
        a = (await store.acquire(RESOURCE, "run-a", 0.2, 0, None, None)).lease
        await written(store, new(a.fence, "one"))
        await asyncio.sleep(0.3)
        assert await refused(store, new(a.fence, "two")) == "lease_expired"
        b = (await store.acquire(RESOURCE, "run-b", 30, 0, None, None)).lease
        assert await refused(store, new(a.fence, "two")) == "stale_fence"
        assert await refused(store, new(b.fence + 1, "two")) == "fence_not_issued"
        assert await refused(store, new(b.fence, "two", owner="run-a")) == "owner_mismatch"
        assert [c.step for c in await store.list_checkpoints(RESOURCE, None, 10)] == ["one"]
        taken = await written(store, new(b.fence, "two", owner="run-b"))
        assert (taken.checkpoint.seq, taken.checkpoint.owner) == (2, "run-b")

    async def test_only_the_acquiring_client_writes_with_clients(self, store) -> None:
        lease = (await store.acquire(RESOURCE, "run-a", 30, 0, "agent-1", None)).lease
        code = await refused(store, new(lease.fence, client="agent-2"), clients=True)
        assert code == "not_lease_holder"
        ok_ = await written(store, new(lease.fence, client="agent-1"), clients=True)
        assert ok_.checkpoint.client == "agent-1"

    async def test_never_issued_resource_is_refused(self, store) -> None:
        assert await refused(store, new(1, resource="never/taken")) == "fence_not_issued"
        records = await store.run_records("never/taken")
        assert records.highest_fence == 0 and records.checkpoint is None

    async def test_external_fences_and_no_fence_moves(self, store) -> None:
        first = await written(store, new(7, owner="w-1"), issuer="external")
        assert first.checkpoint.owner == "w-1"  # X-Lease-Owner as presented
        assert isinstance(await store.admit(call(5, resource=RESOURCE, key="a")), Admitted)
        assert await refused(store, new(4), issuer="external") == "stale_fence"
        assert (await store.run_records(RESOURCE)).highest_fence == 5  # 7 moved nothing

    async def test_concurrent_writes_number_without_gaps(self, store) -> None:
        lease = (await store.acquire(RESOURCE, "run-a", 30, 0, None, None)).lease
        results = await asyncio.gather(
            *(
                store.write_checkpoint(new(lease.fence, f"s{i}"), "gateway", False)
                for i in range(20)
            )
        )
        assert sorted(r.checkpoint.seq for r in results) == list(range(1, 21))
        same = await asyncio.gather(
            *(store.write_checkpoint(new(lease.fence, "same"), "gateway", False) for _ in range(10))
        )
        assert sum(r.created for r in same) == 1
        assert len({r.checkpoint.seq for r in same}) == 1


class TestReading:
    async def test_pages_newest_first(self, store) -> None:
        for i in range(5):
            await written(store, new(3, f"s{i}"), issuer="external")
        assert [c.seq for c in await store.list_checkpoints(RESOURCE, None, 2)] == [5, 4]
        assert [c.seq for c in await store.list_checkpoints(RESOURCE, 4, 2)] == [3, 2]
        assert [c.seq for c in await store.list_checkpoints(RESOURCE, 2, 2)] == [1]
        assert await store.list_checkpoints("other/1", None, 2) == []

    async def test_retention_keeps_the_last(self, store) -> None:
        for i in range(3):
            await written(store, new(3, f"s{i}", retention_s=0.05), issuer="external")
        await written(store, new(3, "other", resource="b/1", retention_s=0.05), issuer="external")
        await written(store, new(3, "kept", retention_s=60), issuer="external")
        await asyncio.sleep(0.15)
        assert await store.prune_checkpoints() == 3  # s0 to s2; b/1's only one is its last
        left = await store.list_checkpoints(RESOURCE, None, 10)
        assert [(c.seq, c.step) for c in left] == [(4, "kept")]
        assert [c.step for c in await store.list_checkpoints("b/1", None, 10)] == ["other"]


class TestRunRecords:
    async def test_receipts_since_the_checkpoint_by_group(self, store) -> None:
        lease = (await store.acquire(RESOURCE, "run-a", 30, 0, None, None)).lease
        fence = lease.fence
        before = await store.admit(call(fence, key="before", issuer="gateway"))
        await store.complete(before.receipt_id, ok())
        await written(store, new(fence, "after-first"))
        done = await store.admit(call(fence, key="done", issuer="gateway"))
        await store.complete(done.receipt_id, ok(500))
        lost = await store.admit(call(fence, key="lost", issuer="gateway"))
        await store.complete(
            lost.receipt_id, Outcome("outcome_unknown", error="upstream_timeout", forwarded_at=1.0)
        )
        in_flight = await store.admit(call(fence, key="flying", issuer="gateway"))
        await store.admit(call(fence + 5, key="x", issuer="gateway"))  # fence_not_issued
        records = await store.run_records(RESOURCE)
        assert records.checkpoint.step == "after-first"
        assert [r.id for r in records.completed] == [done.receipt_id]
        assert [r.id for r in records.needs_confirmation] == [lost.receipt_id, in_flight.receipt_id]
        assert records.rejected == 1
        assert list(records.unknown_since) == ["tool"]
        assert records.lease.owner == "run-a" and records.lease.state == "held"
        assert records.highest_fence == fence
        assert records.now > records.checkpoint.at

    async def test_without_a_checkpoint_every_receipt_counts(self, store) -> None:
        first = await store.admit(call(2, key="a"))
        await store.complete(first.receipt_id, ok())
        records = await store.run_records(RESOURCE)
        assert records.checkpoint is None and records.lease is None
        assert [r.id for r in records.completed] == [first.receipt_id]
        assert records.needs_confirmation == [] and records.unknown_since == {}


class TestRaces:
    async def test_no_checkpoint_of_the_old_owner_lands_after_a_takeover(self, store) -> None:
        """The old owner writes while an admin revokes and a new owner acquires: every
        checkpoint it got in was appended before the new lease existed, by the store's
        clock, and every later one was refused."""
        a = (await store.acquire(RESOURCE, "run-a", 30, 0, None, None)).lease

        async def old_owner() -> list[object]:
            results: list[object] = []
            for n in range(2000):  # until refused: the takeover comes after a few writes
                results.append(
                    await store.write_checkpoint(new(a.fence, f"a{n}"), "gateway", False)
                )
                if isinstance(results[-1], CheckpointRefused) and len(results) > 3:
                    break
            return results

        async def takeover():
            await asyncio.sleep(0.01)
            await store.release(RESOURCE, None, None)
            return (await store.acquire(RESOURCE, "run-b", 30, 0, None, None)).lease

        results, b = await asyncio.gather(old_owner(), takeover())
        landed = [r.checkpoint for r in results if isinstance(r, CheckpointWritten)]
        refused_ = [r.code for r in results if isinstance(r, CheckpointRefused)]
        assert all(c.at < b.acquired_at for c in landed)
        assert set(refused_) <= {"lease_expired", "stale_fence"}
        # refusals only after the last write that landed: a single switch
        kinds = [isinstance(r, CheckpointWritten) for r in results]
        assert kinds == sorted(kinds, reverse=True)
        assert refused_ and landed, "the takeover did not race the writes"


class TestSinceTheCheckpointByTheStoresOrder:
    @pytest.mark.sqlite_only
    async def test_same_tick_and_a_clock_stepping_back(self, tmp_path) -> None:
        """'Since the checkpoint' follows the order things happened in, also when the clock
        does not move between them or steps back."""
        clock = FakeClock(1000.0)
        store = make_store("sqlite", tmp_path, clock=clock)
        await store.open()
        try:
            before = await store.admit(call(3, key="before"))
            await written(store, new(3, "mark"), issuer="external")
            same_tick = await store.admit(call(3, key="same-tick"))
            clock.now = 990.0  # the clock steps back
            stepped_back = await store.admit(call(3, key="stepped-back"))
            records = await store.run_records(RESOURCE)
            assert [r.id for r in records.needs_confirmation] == [
                same_tick.receipt_id,
                stepped_back.receipt_id,
            ]
            assert before.receipt_id < same_tick.receipt_id
        finally:
            await store.close()


class TestAfterARestore:
    """A checkpoint meets the same fence floors as a call (docs/contract.md §18)."""

    async def test_the_floor_and_a_hold_refuse_checkpoints_until_raised(self, store) -> None:
        lease = (await store.acquire(RESOURCE, "run-a", 30, 0, None, None)).lease
        await written(store, new(lease.fence, owner="run-a"))
        await written(store, new(3, resource="ext/1"), issuer="external")
        await store.apply_restore(1000)
        # the old holder's fence is below the floor; the external resource is on hold
        assert await refused(store, new(lease.fence, "later", owner="run-a")) == "stale_fence"
        assert await refused(store, new(4, resource="ext/1"), issuer="external") == "stale_fence"
        await store.raise_fence("ext/1", 9)
        assert await refused(store, new(8, resource="ext/1"), issuer="external") == "stale_fence"
        await written(store, new(9, resource="ext/1"), issuer="external")
        assert (await store.run_records("ext/1")).highest_fence == 9
