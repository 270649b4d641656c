"""The store contract for fence floors (docs/contract.md §18): what a restore and an admin's
raises do to admission and acquisition, on every backend.

A restore sets a store-wide floor for gateway-issued fences and puts every external resource
on hold; raises (one resource, or a glob that also covers resources first seen later) never
lower a fence and lift holds. The SQLite file handling of `fence-gateway restore` and the
real-process story are tested in tests/e2e/test_restore_e2e.py.
"""

import asyncio
import itertools

import pytest

from gateway.core.floors import FencesExhausted
from gateway.core.grammar import MAX_FENCE
from gateway.store.base import Admitted, Refused, Store
from tests.store.test_contract import call, ok

GAP = 1000
_keys = itertools.count()


async def admit(store: Store, fence: int, resource: str, issuer: str = "external", **kw) -> str:
    """The admission's result, each call under a new key: "admitted" (its outcome recorded)
    or the refusal's code."""
    result = await store.admit(
        call(fence, resource=resource, issuer=issuer, key=f"k{next(_keys)}", **kw)
    )
    if isinstance(result, Admitted):
        await store.complete(result.receipt_id, ok())
        return "admitted"
    assert isinstance(result, Refused)
    return result.code


async def holder_call(store: Store, resource: str, owner: str, fence: int) -> str:
    return await admit(store, fence, resource, issuer="gateway", owner=owner)


class TestRestore:
    async def test_floor_refuses_every_older_gateway_fence_before_fence_not_issued(
        self, store: Store
    ) -> None:
        taken = await store.acquire("g/1", "a", 30, 0, None, None)
        assert taken.lease.fence == 1
        assert await holder_call(store, "g/1", "a", 1) == "admitted"
        report = await store.apply_restore(GAP)
        assert (report.highest, report.floor, report.epoch) == (1, 1 + GAP, 1)
        assert report.leases_expired == 1
        # the holder's own fence, and one never issued: both below the floor, both stale
        assert await holder_call(store, "g/1", "a", 1) == "stale_fence"
        assert await holder_call(store, "g/1", "a", 5) == "stale_fence"
        # a resource the store never saw is under the floor too
        assert await holder_call(store, "g/new", "a", 3) == "stale_fence"
        # at or above the floor and never issued: a forgery, as before
        assert await holder_call(store, "g/1", "a", 1 + GAP) == "fence_not_issued"

    async def test_next_acquire_gets_at_least_the_floor_and_fences_never_go_back(
        self, store: Store
    ) -> None:
        await store.acquire("g/1", "a", 30, 0, None, None)
        await store.apply_restore(GAP)
        # the held lease is expired now: another owner may take it (lock delay 0)
        taken = await store.acquire("g/1", "b", 30, 0, None, None)
        assert (taken.result, taken.lease.fence) == ("acquired", 1 + GAP)
        assert await holder_call(store, "g/1", "b", 1 + GAP) == "admitted"
        fresh = await store.acquire("g/never-seen", "b", 30, 0, None, None)
        assert fresh.lease.fence == 1 + GAP
        again = await store.acquire("g/never-seen", "c", 30, 0, None, None)
        assert again.result == "held"
        # a second restore stands above everything the first one issued
        second = await store.apply_restore(GAP)
        assert (second.highest, second.floor, second.epoch) == (1 + GAP, 1 + 2 * GAP, 2)
        assert (await store.acquire("g/1", "d", 30, 0, None, None)).lease.fence == 1 + 2 * GAP

    async def test_beyond_the_replaced_store(self, store: Store) -> None:
        await store.acquire("g/1", "a", 30, 0, None, None)
        report = await store.apply_restore(GAP, beyond=5000)
        assert (report.highest, report.floor) == (5000, 5000 + GAP)
        assert await store.highest_fence() == 5000 + GAP

    async def test_held_leases_expire_and_pending_receipts_become_outcome_unknown(
        self, store: Store
    ) -> None:
        await store.acquire("g/1", "a", 30, 0, None, None)
        pending = await store.admit(call(1, resource="g/1", issuer="gateway", key="p"))
        assert isinstance(pending, Admitted)
        report = await store.apply_restore(GAP)
        assert report.receipts_unknown == {"tool": 1}
        lease = await store.get_lease("g/1")
        assert lease is not None and lease.to_json()["state"] == "expired"
        receipt = await store.get_receipt(pending.receipt_id)
        assert receipt is not None
        assert (receipt.status, receipt.error) == ("outcome_unknown", "store_restored")
        # the sweeper marks the lease expired like any other (and owes its cleanup)
        expired = await store.expire_leases(lambda resource, owner: 0.0)
        assert [lease.resource for lease in expired] == ["g/1"]
        assert [c.resource for c in await store.list_cleanups()] == ["g/1"]

    async def test_external_resources_are_on_hold_known_or_not_until_raised(
        self, store: Store
    ) -> None:
        assert await admit(store, 40, "ext/a") == "admitted"
        await store.apply_restore(GAP)
        # on hold: any token, even far above everything, known resource or not
        assert await admit(store, 10**12, "ext/a") == "stale_fence"
        assert await admit(store, 7, "ext/b") == "stale_fence"
        assert await store.raise_fence("ext/a", 60) == 60
        assert await admit(store, 59, "ext/a") == "stale_fence"
        assert await admit(store, 60, "ext/a") == "admitted"
        assert await admit(store, 7, "ext/b") == "stale_fence"  # still on hold
        # a glob raise covers resources first seen later
        # ext/a is known; ext/b, seen only in refusals, is known to PostgreSQL (its lock row)
        assert await store.raise_fences("ext/*", 100) in (1, 2)
        assert await admit(store, 99, "ext/c") == "stale_fence"
        assert await admit(store, 100, "ext/c") == "admitted"
        assert await admit(store, 100, "ext/a") == "admitted"
        assert await admit(store, 60, "ext/a") == "stale_fence"
        # a raise made before a restore does not lift the next restore's hold
        await store.apply_restore(GAP)
        assert await admit(store, 10**6, "ext/c") == "stale_fence"
        assert await admit(store, 10**6, "other/x") == "stale_fence"


class TestRaises:
    async def test_a_raise_never_lowers(self, store: Store) -> None:
        assert await admit(store, 50, "ext/a") == "admitted"
        assert await store.raise_fence("ext/a", 10) == 50
        assert await admit(store, 50, "ext/a") == "admitted"
        assert await store.raise_fence("ext/a", 70) == 70
        assert await store.raise_fence("ext/a", 60) == 70
        assert await admit(store, 69, "ext/a") == "stale_fence"
        assert await store.raise_fence("ext/new", 5) == 5

    async def test_no_fence_is_issued_past_the_range(self, store: Store) -> None:
        assert await store.raise_fence("g/end", MAX_FENCE - 1) == MAX_FENCE - 1
        taken = await store.acquire("g/end", "a", 30, 0, None, None)
        assert taken.lease.fence == MAX_FENCE
        await store.release("g/end", None, None)
        with pytest.raises(FencesExhausted):
            await store.acquire("g/end", "b", 30, 0, None, None)
        lease = await store.get_lease("g/end")
        assert lease is not None and (lease.owner, lease.fence) == ("a", MAX_FENCE)

    async def test_raising_a_gateway_resource_fences_out_its_holder(self, store: Store) -> None:
        await store.acquire("g/1", "a", 30, 0, None, None)
        assert await holder_call(store, "g/1", "a", 1) == "admitted"
        assert await store.raise_fence("g/1", 500) == 500
        assert await holder_call(store, "g/1", "a", 1) == "stale_fence"
        await store.release("g/1", None, None)
        assert (await store.acquire("g/1", "b", 30, 0, None, None)).lease.fence == 501

    async def test_a_glob_raise_covers_known_and_later_gateway_resources(
        self, store: Store
    ) -> None:
        await store.acquire("team/a/1", "a", 30, 0, None, None)
        await store.acquire("team/b/1", "a", 30, 0, None, None)
        assert await store.raise_fences("team/a/**", 300) == 1
        assert await holder_call(store, "team/a/1", "a", 1) == "stale_fence"
        assert await holder_call(store, "team/b/1", "a", 1) == "admitted"
        later = await store.acquire("team/a/later/x", "a", 30, 0, None, None)
        assert later.lease.fence == 301
        # the same glob raised again keeps the higher value
        assert await store.raise_fences("team/a/**", 200) == 2
        assert (await store.acquire("team/a/z", "a", 30, 0, None, None)).lease.fence == 301
        assert await store.highest_fence() == 301
        assert await store.known_resources() == [
            "team/a/1",
            "team/a/later/x",
            "team/a/z",
            "team/b/1",
        ]

    async def test_concurrent_raises_and_admissions_never_admit_below_a_raise(
        self, store: Store
    ) -> None:
        """Admissions racing a raise: once the raise returned, nothing below it is admitted."""
        assert await admit(store, 1, "ext/race") == "admitted"
        after: list[str] = []

        async def raise_then_probe() -> None:
            await store.raise_fences("ext/*", 1000)
            after.append(await admit(store, 999, "ext/race"))

        results = await asyncio.gather(
            *(admit(store, f, "ext/race") for f in range(2, 40)), raise_then_probe()
        )
        assert after == ["stale_fence"]
        assert {r for r in results if r is not None} <= {"admitted", "stale_fence"}
