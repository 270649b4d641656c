"""The store contract, decision by decision: what a store answers and what it leaves behind
for each case of docs/contract.md §3 (outcomes), §4 (idempotency), §6 (leases) and §9
(expiry), so that a second backend inherits every one of them.

Where time is the subject, the store's clock is a `FakeClock` moved by hand (`clocked_store`,
`clock`). PostgreSQL takes its time from the database, so those tests are `sqlite_only`; the
others run on every backend.
"""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.store.base import (
    Admitted,
    Completion,
    Outcome,
    Refused,
    Replayed,
    Store,
)
from tests.harness import FakeClock
from tests.store.conftest import make_store
from tests.store.test_contract import NO_WAIT, call, ok

START = 1_000.0  # the fake clock's start, in epoch seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
async def clocked_store(backend: str, tmp_path: Path, clock: FakeClock) -> AsyncIterator[Store]:
    """A store whose clock is `clock`: only `clock.advance(s)` moves its time."""
    store = make_store(backend, tmp_path, clock=clock)
    await store.open()
    yield store
    await store.close()


def no_cleanup(_resource: str, _owner: str) -> None:
    return None


# ------------------------------------------------------------------------------------------
# Leases (§6)
# ------------------------------------------------------------------------------------------


class TestAcquireRetry:
    """A keyed acquire repeated by the same client and owner answers the same lease
    (`retried`, same fence); anyone else, the same owner name included, gets `held`."""

    async def test_the_same_client_and_key_get_the_same_lease(self, store: Store) -> None:
        taken = await store.acquire("r/1", "a", 30, 0, "client-1", "k-1")
        again = await store.acquire("r/1", "a", 30, 0, "client-1", "k-1")
        assert (taken.result, again.result) == ("acquired", "retried")
        assert (again.lease.fence, again.lease.owner, again.lease.state) == (
            taken.lease.fence,
            "a",
            "held",
        )
        assert again.held_seconds is None
        assert (await store.get_lease("r/1")).fence == taken.lease.fence

    @pytest.mark.parametrize(
        ("owner", "client", "key"),
        [
            ("a", "client-2", "k-1"),  # another client with the same key
            ("a", None, "k-1"),
            ("a", "client-1", "k-2"),  # the same client with another key
            ("a", "client-1", None),
            ("b", "client-1", "k-1"),  # another owner name
        ],
    )
    async def test_anyone_else_gets_held(
        self, store: Store, owner: str, client: str | None, key: str | None
    ) -> None:
        taken = await store.acquire("r/1", "a", 30, 0, "client-1", "k-1")
        other = await store.acquire("r/1", owner, 30, 0, client, key)
        assert (other.result, other.lease.owner, other.lease.fence) == (
            "held",
            "a",
            taken.lease.fence,
        )
        assert (await store.get_lease("r/1")).client == "client-1"


@pytest.mark.sqlite_only
class TestLockDelay:
    """An expired lease is free only `lock_delay_s` (the acquirer's) after its expiry, by the
    store's clock; a lease released by its holder is free at once."""

    async def test_free_exactly_lock_delay_after_expiry(
        self, clocked_store: Store, clock: FakeClock
    ) -> None:
        store = clocked_store
        await store.acquire("r/1", "a", 10, 5, None, None)
        clock.advance(10)  # expired now: now >= expires_at
        early = await store.acquire("r/1", "b", 10, 5, None, None)
        assert (early.result, early.lease.owner, early.lease.state) == ("held", "a", "expired")
        clock.advance(4)
        assert (await store.acquire("r/1", "b", 10, 5, None, None)).result == "held"
        clock.advance(1)  # expires_at + lock_delay_s
        taken = await store.acquire("r/1", "b", 10, 5, None, None)
        assert (taken.result, taken.lease.owner, taken.lease.fence) == ("acquired", "b", 2)
        assert taken.held_seconds == 10  # taken over before the sweeper marked it

    async def test_a_keyed_retry_after_expiry_is_not_the_same_lease(
        self, clocked_store: Store, clock: FakeClock
    ) -> None:
        store = clocked_store
        await store.acquire("r/1", "a", 10, 0, "client-1", "k-1")
        clock.advance(10)
        again = await store.acquire("r/1", "a", 10, 0, "client-1", "k-1")
        assert (again.result, again.lease.fence) == ("acquired", 2)

    async def test_a_released_lease_waits_for_no_lock_delay(self, clocked_store: Store) -> None:
        store = clocked_store
        await store.acquire("r/1", "a", 10, 5, None, None)
        assert (await store.release("r/1", "a", 1)).ok is True
        taken = await store.acquire("r/1", "b", 10, 5, None, None)
        assert (taken.result, taken.lease.fence, taken.held_seconds) == ("acquired", 2, None)


class TestRenewRefused:
    """Only the live lease's own holder (owner, fence and acquiring client) renews it; a
    refused renewal is None and changes nothing."""

    @pytest.mark.parametrize(
        ("owner", "fence", "client"),
        [("b", 1, "client-1"), ("a", 2, "client-1"), ("a", 1, "client-2"), ("a", 1, None)],
    )
    async def test_not_the_holder(
        self, store: Store, owner: str, fence: int, client: str | None
    ) -> None:
        await store.acquire("r/1", "a", 30, 0, "client-1", None)
        before = await store.get_lease("r/1")
        assert await store.renew("r/1", owner, fence, 60, client) is None
        assert await store.get_lease("r/1") == before

    async def test_a_released_or_unknown_lease(self, store: Store) -> None:
        await store.acquire("r/1", "a", 30, 0, None, None)
        await store.release("r/1", "a", 1)
        assert await store.renew("r/1", "a", 1, 60) is None
        assert (await store.get_lease("r/1")).state == "released"
        assert await store.renew("r/never", "a", 1, 60) is None

    @pytest.mark.sqlite_only
    async def test_after_expiry_even_by_its_holder(
        self, clocked_store: Store, clock: FakeClock
    ) -> None:
        store = clocked_store
        await store.acquire("r/1", "a", 10, 0, None, None)
        clock.advance(9)
        renewed = await store.renew("r/1", "a", 1, 20)
        assert (renewed.renewed_at, renewed.expires_at) == (START + 9, START + 29)
        clock.advance(20)  # now == expires_at
        assert await store.renew("r/1", "a", 1, 20) is None
        assert (await store.get_lease("r/1")).expires_at == START + 29


class TestRelease:
    """A release by anyone but the holder is not ok and changes nothing; revoking (owner
    None) needs no holder."""

    @pytest.mark.parametrize(
        ("owner", "fence", "client"),
        [("b", 1, "client-1"), ("a", 2, "client-1"), ("a", 1, "client-2"), ("a", 1, None)],
    )
    async def test_a_non_holder_is_not_ok(
        self, store: Store, owner: str, fence: int, client: str | None
    ) -> None:
        await store.acquire("r/1", "a", 30, 0, "client-1", None)
        before = await store.get_lease("r/1")
        assert (await store.release("r/1", owner, fence, client)).ok is False
        assert await store.get_lease("r/1") == before

    async def test_a_resource_never_leased(self, store: Store) -> None:
        assert (await store.release("r/never", "a", 1)).ok is False
        assert (await store.release("r/never", None, None)).ok is True
        assert await store.get_lease("r/never") is None

    async def test_the_holder_may_release_twice(self, store: Store) -> None:
        await store.acquire("r/1", "a", 30, 0, None, None)
        first = await store.release("r/1", "a", 1)
        second = await store.release("r/1", "a", 1)
        assert (first.ok, second.ok, second.held_seconds) == (True, True, None)
        assert (await store.get_lease("r/1")).state == "released"

    @pytest.mark.sqlite_only
    async def test_an_expired_untaken_lease_is_ok_and_left_to_the_sweeper(
        self, clocked_store: Store, clock: FakeClock
    ) -> None:
        """Not released: it stays expired, so the lock delay still applies and the sweeper
        still marks it (and owes its cleanup, below)."""
        store = clocked_store
        await store.acquire("r/1", "a", 10, 0, None, None)
        clock.advance(10)
        released = await store.release("r/1", "a", 1)
        assert (released.ok, released.held_seconds) == (True, None)
        assert (await store.get_lease("r/1")).state == "expired"
        assert await store.list_leases(None, "released", None, 10) == []
        assert (await store.acquire("r/1", "b", 10, 5, None, None)).result == "held"
        [marked] = await store.expire_leases(no_cleanup)
        assert (marked.resource, marked.fence) == ("r/1", 1)

    @pytest.mark.sqlite_only
    async def test_a_release_after_expiry_still_owes_its_cleanup(
        self, clocked_store: Store, clock: FakeClock
    ) -> None:
        store = clocked_store
        taken = await store.acquire("run/a", "w", 0.05, 0, None, None)
        clock.advance(0.1)
        released = await store.release("run/a", "w", taken.lease.fence)
        assert (released.ok, released.held_seconds) == (True, None)
        [expired] = await store.expire_leases(lambda resource, owner: 0.0)
        assert (expired.resource, expired.fence) == ("run/a", taken.lease.fence)
        assert (await store.get_lease("run/a")).state == "expired"
        assert [c.resource for c in await store.list_cleanups()] == ["run/a"]


@pytest.mark.sqlite_only
class TestRevoke:
    """Revoking (owner and fence None) releases the lease, expired ones too: the next
    acquire gets a new fence at once, with no lock delay."""

    @pytest.mark.parametrize("swept", [True, False], ids=["marked", "unmarked"])
    async def test_revoking_an_expired_lease_skips_the_lock_delay(
        self, clocked_store: Store, clock: FakeClock, swept: bool
    ) -> None:
        store = clocked_store
        await store.acquire("r/1", "a", 10, 0, None, None)
        clock.advance(10)
        if swept:
            assert len(await store.expire_leases(no_cleanup)) == 1
        assert (await store.acquire("r/1", "b", 10, 5, None, None)).result == "held"
        assert (await store.release("r/1", None, None)).ok is True
        assert (await store.get_lease("r/1")).state == "released"
        taken = await store.acquire("r/1", "b", 10, 5, None, None)
        assert (taken.result, taken.lease.fence) == ("acquired", 2)

    async def test_revoking_a_live_lease(self, clocked_store: Store, clock: FakeClock) -> None:
        store = clocked_store
        await store.acquire("r/1", "a", 10, 0, None, None)
        clock.advance(4)
        revoked = await store.release("r/1", None, None)
        assert (revoked.ok, revoked.held_seconds) == (True, 4)
        assert (await store.acquire("r/1", "b", 10, 5, None, None)).lease.fence == 2


# ------------------------------------------------------------------------------------------
# Expiry and fences (§6, §9)
# ------------------------------------------------------------------------------------------


@pytest.mark.sqlite_only
class TestExpireLeases:
    """`expire_leases` marks held leases past expiry `expired`, returns those it marked (as
    they were), and writes the cleanups they owe, asking `cleanup_delay` for each."""

    async def test_returns_what_it_marked_and_writes_owed_cleanups(
        self, clocked_store: Store, clock: FakeClock
    ) -> None:
        store = clocked_store
        asked: list[tuple[str, str]] = []

        def cleanup_delay(resource: str, owner: str) -> float | None:
            asked.append((resource, owner))
            return 2.0 if resource.startswith("browser/") else None

        await store.acquire("run/a", "w1", 10, 0, None, None)
        await store.acquire("browser/a", "w2", 10, 0, None, None)
        await store.acquire("browser/b", "w3", 30, 0, None, None)  # still live
        await store.acquire("browser/c", "w4", 10, 0, None, None)
        await store.release("browser/c", "w4", 1)  # released: nothing to expire
        clock.advance(10)
        marked = await store.expire_leases(cleanup_delay)
        assert sorted((m.resource, m.owner, m.fence, m.expires_at) for m in marked) == [
            ("browser/a", "w2", 1, START + 10),
            ("run/a", "w1", 1, START + 10),
        ]
        assert sorted(asked) == [("browser/a", "w2"), ("run/a", "w1")]
        assert [
            (o.resource, o.lease_fence, o.lease_owner, o.due_at, o.attempts, o.sweep_fence)
            for o in await store.list_cleanups()
        ] == [("browser/a", 1, "w2", START + 12, 0, None)]
        assert [(await store.get_lease(r)).state for r in ("run/a", "browser/a", "browser/b")] == [
            "expired",
            "expired",
            "held",
        ]
        assert await store.due_cleanups(10) == []  # due lock_delay_s after the expiry
        clock.advance(2)
        assert await store.due_cleanups(10) == ["browser/a"]

    async def test_a_lease_is_marked_once(self, clocked_store: Store, clock: FakeClock) -> None:
        store = clocked_store
        await store.acquire("browser/a", "w", 10, 0, None, None)
        clock.advance(10)
        assert len(await store.expire_leases(lambda resource, owner: 0.0)) == 1
        asked: list[str] = []
        assert await store.expire_leases(lambda resource, owner: asked.append(resource)) == []
        assert asked == []
        assert len(await store.list_cleanups()) == 1

    async def test_without_a_callback_nothing_is_owed(
        self, clocked_store: Store, clock: FakeClock
    ) -> None:
        store = clocked_store
        await store.acquire("browser/a", "w", 10, 0, None, None)
        clock.advance(10)
        assert [m.resource for m in await store.expire_leases()] == ["browser/a"]
        assert await store.list_cleanups() == []


class TestFencesNeverGoBack:
    """Each ownership change issues the next fence, whatever became of the lease record
    before: released, expired and marked by the sweeper, the sweeper's own cleanup lease,
    a restart."""

    @pytest.mark.sqlite_only
    async def test_the_fence_after_a_swept_lease_keeps_growing(
        self, clocked_store: Store, clock: FakeClock
    ) -> None:
        store = clocked_store
        fences = [(await store.acquire("browser/a", "w1", 10, 0, None, None)).lease.fence]
        clock.advance(10)
        await store.expire_leases(lambda resource, owner: 0.0)  # the sweeper marks it
        claimed = await store.claim_cleanup("browser/a", "gateway-sweeper:s", 5, 0, 1)
        fences.append(claimed.fence)
        await store.finish_cleanup("browser/a", claimed.fence, done=True)
        await store.release("browser/a", "gateway-sweeper:s", claimed.fence)
        fences.append((await store.acquire("browser/a", "w2", 10, 0, None, None)).lease.fence)
        clock.advance(10)
        await store.expire_leases(no_cleanup)
        fences.append((await store.acquire("browser/a", "w3", 10, 0, None, None)).lease.fence)
        assert fences == [1, 2, 3, 4]

    async def test_and_across_a_restart(self, backend: str, tmp_path: Path) -> None:
        first = make_store(backend, tmp_path, instance="run-1")
        await first.open()
        await first.acquire("r/1", "a", 30, 0, None, None)
        await first.release("r/1", "a", 1)
        await first.close()
        second = make_store(backend, tmp_path, instance="run-2")
        await second.open()
        try:
            assert (await second.acquire("r/1", "b", 30, 0, None, None)).lease.fence == 2
        finally:
            await second.close()


# ------------------------------------------------------------------------------------------
# Outcomes and idempotency (§3, §4)
# ------------------------------------------------------------------------------------------


class TestCompleteOnce:
    """An outcome is recorded once: completing a receipt that already has its outcome is
    `unchanged` and changes nothing, the stored answer included."""

    @pytest.mark.parametrize(
        "second",
        [
            ok(500, b"other"),
            ok(200, b"other"),
            Outcome("not_sent", error="upstream_unreachable"),
            Outcome("outcome_unknown", error="upstream_timeout"),
        ],
        ids=["failed", "succeeded", "not_sent", "outcome_unknown"],
    )
    async def test_a_completed_receipt_is_unchanged(self, store: Store, second: Outcome) -> None:
        admitted = await store.admit(call(1))
        assert await store.complete(admitted.receipt_id, ok(201, b"done")) == Completion.RECORDED
        before = await store.get_receipt(admitted.receipt_id)
        assert await store.complete(admitted.receipt_id, second) == Completion.UNCHANGED
        assert await store.get_receipt(admitted.receipt_id) == before
        replay = await store.admit(call(1))
        assert (replay.status, replay.body) == (201, b"done")

    async def test_a_second_unknown_on_an_unknown_receipt_is_unchanged(self, store: Store) -> None:
        admitted = await store.admit(call(1))
        first = await store.complete(
            admitted.receipt_id, Outcome("outcome_unknown", error="upstream_timeout")
        )
        assert first == Completion.RECORDED
        before = await store.get_receipt(admitted.receipt_id)
        assert (before.status, before.error) == ("outcome_unknown", "upstream_timeout")
        for again in (
            Outcome("outcome_unknown", error="upstream_outcome_unknown"),
            Outcome("not_sent", error="upstream_unreachable"),
        ):
            assert await store.complete(admitted.receipt_id, again) == Completion.UNCHANGED
        assert await store.get_receipt(admitted.receipt_id) == before
        refused = await store.admit(call(1))
        assert (refused.code, refused.holder_receipt_id) == ("outcome_unknown", admitted.receipt_id)

    async def test_an_unknown_turned_by_the_sweeper_is_unchanged_too(self, store: Store) -> None:
        admitted = await store.admit(call(1))
        await store.expire_pending(NO_WAIT, 60, frozenset())
        before = await store.get_receipt(admitted.receipt_id)
        second = Outcome("outcome_unknown", error="upstream_timeout")
        assert await store.complete(admitted.receipt_id, second) == Completion.UNCHANGED
        assert await store.get_receipt(admitted.receipt_id) == before

    async def test_an_unknown_receipt_id_is_missing(self, store: Store) -> None:
        assert await store.complete("01NOSUCHRECEIPT", ok()) == Completion.MISSING


class TestIncompleteAnswers:
    """`mark_incomplete`: the answer's body broke after its outcome was recorded, so it is
    not replayable; the next identical call is refused `already_completed`."""

    async def test_a_succeeded_answer_is_no_longer_replayed(self, store: Store) -> None:
        admitted = await store.admit(call(1))
        await store.complete(admitted.receipt_id, ok(200, b"half"))
        await store.mark_incomplete(admitted.receipt_id)
        refused = await store.admit(call(1))
        assert isinstance(refused, Refused)
        assert (refused.code, refused.holder_receipt_id) == (
            "already_completed",
            admitted.receipt_id,
        )
        receipt = await store.get_receipt(admitted.receipt_id)
        assert (receipt.status, receipt.http_status, receipt.error) == (
            "succeeded",
            200,
            "response_incomplete",
        )

    async def test_without_it_the_answer_is_replayed(self, store: Store) -> None:
        admitted = await store.admit(call(1))
        await store.complete(admitted.receipt_id, ok(200, b"whole"))
        assert isinstance(await store.admit(call(1)), Replayed)


@pytest.mark.sqlite_only
class TestAttemptsAfterRetention:
    """`attempt` is 1 + the earlier non-rejected receipts with the key on the resource, also
    once the key itself was pruned after its retention."""

    async def test_the_attempt_counts_receipts_of_a_pruned_key(
        self, clocked_store: Store, clock: FakeClock
    ) -> None:
        store = clocked_store
        first = await store.admit(call(1))  # retention_s=60
        await store.complete(first.receipt_id, ok(503))  # a retry status: a new attempt
        second = await store.admit(call(1))
        await store.complete(second.receipt_id, ok(201, b"done"))
        reused = await store.admit(call(1, fp="sha256:other"))
        assert (reused.code, (first.attempt, second.attempt)) == ("idempotency_key_reused", (1, 2))
        assert isinstance(await store.admit(call(1)), Replayed)  # the key is still kept
        clock.advance(60.5)  # past the key's retention, not the receipts'
        assert await store.prune(3600) == 0
        third = await store.admit(call(1))
        assert isinstance(third, Admitted)
        assert third.attempt == 3  # not 4: the rejected receipt claimed no key

    async def test_a_key_within_its_retention_is_kept(
        self, clocked_store: Store, clock: FakeClock
    ) -> None:
        store = clocked_store
        admitted = await store.admit(call(1))
        await store.complete(admitted.receipt_id, ok(201, b"done"))
        clock.advance(59.5)
        await store.prune(3600)
        assert isinstance(await store.admit(call(1)), Replayed)


# ------------------------------------------------------------------------------------------
# Receipt ids (§7)
# ------------------------------------------------------------------------------------------


class TestIdsAcrossRestarts:
    """Receipt ids sort in creation order, also across a restart."""

    @pytest.mark.sqlite_only
    async def test_ids_keep_their_order_when_the_clock_goes_back(
        self, backend: str, tmp_path: Path
    ) -> None:
        """A wall clock stepped back across a restart (the one thing here that cannot be
        had for real, so the store's clock is set by hand)."""
        first = make_store(backend, tmp_path, instance="one")
        await first.open()
        before = await first.admit(call(1, key="a"))
        await first.close()
        second = make_store(backend, tmp_path, instance="two", clock=FakeClock(1e9))
        await second.open()
        try:
            after = await second.admit(call(1, key="b"))
        finally:
            await second.close()
        assert after.receipt_id > before.receipt_id
