"""The store contract for sweeper cleanups (docs/contract.md §9): what every backend does
with the cleanup an expired lease owes.

Scheduled in the expiry's transaction, kept across restarts, claimed by one sweeper at a time
(the claim is an acquire: a new fence), dropped when a new owner took the resource over. The
sweeper that sends the call is tested in tests/test_leases_api.py; here races are staged on
the store itself.
"""

import asyncio
import time
from pathlib import Path
from typing import Any

from gateway.store.base import Store
from tests.store.conftest import make_store


def owed(resource: str, owner: str) -> float | None:
    """The `cleanup_delay` of these tests: `browser/*` owes a cleanup at once, except after
    the sweeper's own leases."""
    if owner.startswith("gateway-sweeper:") or not resource.startswith("browser/"):
        return None
    return 0.0


async def expire(store: Store, resource: str, owner: str = "worker-a") -> None:
    await store.acquire(resource, owner, 0.05, 0, None, None)
    await asyncio.sleep(0.06)
    await store.expire_leases(owed)


async def claim(store: Store, resource: str, owner: str = "gateway-sweeper:s1") -> Any:
    return await store.claim_cleanup(resource, owner, 5, 0, 1)


class TestCleanupBookkeeping:
    """The store's side of cleanups: scheduled with the expiry, kept across restarts, claimed
    by one sweeper at a time, dropped when a new owner took over."""

    async def test_scheduled_only_where_owed_and_kept_across_a_restart(
        self, backend: str, tmp_path: Path
    ) -> None:
        first = make_store(backend, tmp_path, instance="run-1")
        await first.open()
        await expire(first, "browser/a")
        await expire(first, "run/a")
        await first.close()
        reopened = make_store(backend, tmp_path, instance="run-2")
        await reopened.open()
        try:
            owed_now = await reopened.list_cleanups()
            assert [
                (o.resource, o.lease_fence, o.lease_owner, o.attempts, o.sweep_fence)
                for o in owed_now
            ] == [("browser/a", 1, "worker-a", 0, None)]
            assert await reopened.due_cleanups(10) == ["browser/a"]
        finally:
            await reopened.close()

    async def test_two_sweepers_claim_it_once(self, store: Store) -> None:
        await expire(store, "browser/a")
        first, second = await asyncio.gather(
            claim(store, "browser/a"), claim(store, "browser/a", "gateway-sweeper:s2")
        )
        assert sorted([first.state, second.state]) == ["busy", "claimed"]
        won = first if first.state == "claimed" else second
        assert (won.fence, won.key, won.attempt, won.lease_fence, won.lease_owner) == (
            2,
            "gw-sweep-2",
            1,
            1,
            "worker-a",
        )

    async def test_a_finished_cleanup_is_not_claimed_again(self, store: Store) -> None:
        await expire(store, "browser/a")
        claimed = await claim(store, "browser/a")
        await store.finish_cleanup("browser/a", claimed.fence, done=True)
        await store.release("browser/a", "gateway-sweeper:s1", claimed.fence)
        assert (await claim(store, "browser/a", "gateway-sweeper:s2")).state == "not_due"
        assert await store.list_cleanups() == []

    async def test_a_new_owner_supersedes_it(self, store: Store) -> None:
        await expire(store, "browser/a")
        taken = await store.acquire("browser/a", "worker-b", 5, 0, None, None)
        assert (taken.result, taken.lease.fence) == ("acquired", 2)
        superseded = await claim(store, "browser/a")
        assert (superseded.state, superseded.holder) == ("superseded", "worker-b")
        assert await store.list_cleanups() == []

    async def test_a_newer_expiry_replaces_an_older_one(self, store: Store) -> None:
        await expire(store, "browser/a")
        await expire(store, "browser/a", "worker-b")
        [owed_now] = await store.list_cleanups()
        assert (owed_now.lease_fence, owed_now.lease_owner) == (2, "worker-b")

    async def test_a_failed_attempt_is_tried_again_under_a_new_fence(self, store: Store) -> None:
        await expire(store, "browser/a")
        claimed = await claim(store, "browser/a")
        await store.finish_cleanup(
            "browser/a", claimed.fence, done=False, retry_at=time.time(), error="http_500"
        )
        await store.release("browser/a", "gateway-sweeper:s1", claimed.fence)
        again = await claim(store, "browser/a")
        assert (again.state, again.fence, again.attempt) == ("claimed", 3, 2)

    async def test_an_interrupted_attempt_waits_then_its_expiry_owes_nothing_new(
        self, store: Store
    ) -> None:
        """A sweeper that died mid-call leaves a pending receipt-less claim and a held lease:
        the next claim waits for that lease; its expiry schedules nothing of its own."""
        await expire(store, "browser/a")
        claimed = await store.claim_cleanup("browser/a", "gateway-sweeper:s1", 0.3, 0, 0)
        assert (
            await store.claim_cleanup("browser/a", "gateway-sweeper:s2", 5, 0, 0)
        ).state == "busy"
        await asyncio.sleep(0.35)
        await store.expire_leases(owed)
        [owed_now] = await store.list_cleanups()
        assert (owed_now.lease_fence, owed_now.sweep_fence) == (1, claimed.fence)
        retried = await claim(store, "browser/a", "gateway-sweeper:s2")
        assert (retried.state, retried.fence) == ("claimed", 3)
