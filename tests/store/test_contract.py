"""The store contract: what every backend must do, atomically and durably."""

import asyncio
import dataclasses
import random

from gateway.core.receipts import ReconcileWaits
from gateway.store.base import Admitted, Call, Outcome, ReceiptQuery, Refused, Rejection, Replayed

RETRY = frozenset({408, 425, 429, 503})
NO_WAIT = ReconcileWaits({}, default=0)  # every receipt is past its grace at once


def call(
    fence: int,
    *,
    resource: str = "acct/1",
    key: str = "k1",
    fp: str = "sha256:a",
    issuer: str = "external",
    owner: str | None = None,
) -> Call:
    return Call(
        resource=resource,
        fence=fence,
        owner=owner,
        client=None,
        upstream="tool",
        method="POST",
        path="/x",
        issuer=issuer,
        idempotency_key=key,
        fingerprint=fp,
        retry_statuses=RETRY,
        retention_s=60,
    )


def ok(status: int = 200, body: bytes = b"{}") -> Outcome:
    return Outcome(
        "succeeded" if status < 300 else "failed",
        http_status=status,
        forwarded_at=1.0,
        response=([("Content-Type", "application/json")], body),
    )


class TestExternalFences:
    """The highest accepted fence only grows; older tokens are refused and recorded."""

    async def test_cas(self, store) -> None:
        first = await store.admit(call(5, key="a"))
        assert isinstance(first, Admitted) and first.attempt == 1
        assert isinstance(await store.admit(call(5, key="b")), Admitted)  # equal is fine
        stale = await store.admit(call(4, key="c"))
        assert isinstance(stale, Refused) and stale.code == "stale_fence"
        receipt = (await store.get_receipt(stale.receipt_id)).to_json()
        assert {
            k: receipt[k]
            for k in (
                "status",
                "reject_code",
                "fence",
                "idempotency_key",
                "fingerprint",
                "attempt",
                "http_status",
            )
        } == {
            "status": "rejected",
            "reject_code": "stale_fence",
            "fence": 4,
            "idempotency_key": None,
            "fingerprint": None,
            "attempt": None,
            "http_status": 409,
        }

    async def test_concurrent_admissions_never_accept_below_an_accepted_fence(self, store):
        fences = list(range(1, 101))
        random.Random(7).shuffle(fences)
        results = await asyncio.gather(*(store.admit(call(f, key=f"k{f}")) for f in fences))
        in_commit_order = sorted(
            (r.receipt_id, f, isinstance(r, Admitted)) for r, f in zip(results, fences, strict=True)
        )
        highest = 0
        for _, fence, admitted in in_commit_order:
            assert admitted == (fence >= highest), (fence, highest)
            highest = max(highest, fence) if admitted else highest
        assert sum(admitted for *_, admitted in in_commit_order) < 100  # some were refused

    async def test_resources_are_independent(self, store) -> None:
        await store.admit(call(9, resource="a/1"))
        assert isinstance(await store.admit(call(1, resource="a/2")), Admitted)


class TestIdempotency:
    """Keys are claimed in the admission transaction and settle with the outcome."""

    async def test_replay_after_success(self, store) -> None:
        first = await store.admit(call(1))
        assert await store.complete(first.receipt_id, ok(201, b"done")) == "recorded"
        again = await store.admit(call(2))  # a new owner retrying its predecessor's call
        assert again == Replayed(
            first.receipt_id, 201, [("Content-Type", "application/json")], b"done"
        )

    async def test_in_flight_and_reuse(self, store) -> None:
        first = await store.admit(call(1))
        busy = await store.admit(call(1))
        assert (busy.code, busy.holder_receipt_id) == ("idempotency_in_flight", first.receipt_id)
        reused = await store.admit(call(1, fp="sha256:b"))
        assert reused.code == "idempotency_key_reused"
        rejected = await store.get_receipt(reused.receipt_id)
        assert (rejected.idempotency_key, rejected.fingerprint) == ("k1", "sha256:b")

    async def test_simultaneous_identical_calls_admit_once(self, store) -> None:
        results = await asyncio.gather(*(store.admit(call(1)) for _ in range(20)))
        assert sum(isinstance(r, Admitted) for r in results) == 1

    async def test_retry_status_and_not_sent_give_new_attempts(self, store) -> None:
        first = await store.admit(call(1))
        await store.complete(first.receipt_id, ok(503))
        second = await store.admit(call(1))
        assert isinstance(second, Admitted) and second.attempt == 2
        await store.complete(second.receipt_id, Outcome("not_sent", error="upstream_unreachable"))
        third = await store.admit(call(1))
        assert third.attempt == 3

    async def test_refusal_still_advances_the_fence(self, store) -> None:
        await store.admit(call(1))
        refused = await store.admit(call(7))  # in flight, but fence 7 fences out fence 1
        assert refused.code == "idempotency_in_flight"
        assert (await store.admit(call(6, key="other"))).code == "stale_fence"


class TestOutcomes:
    async def test_late_outcome_after_unknown(self, store) -> None:
        admitted = await store.admit(call(1))
        assert await store.expire_pending(NO_WAIT, 60, frozenset()) == {"tool": 1}
        assert await store.complete(admitted.receipt_id, ok()) == "late"
        receipt = await store.get_receipt(admitted.receipt_id)
        assert (receipt.status, receipt.late) == ("succeeded", True)

    async def test_late_outcome_after_reconciliation_is_kept_as_error(self, store) -> None:
        admitted = await store.admit(call(1))
        await store.expire_pending(NO_WAIT, 60, frozenset())
        resolved = await store.resolve(
            admitted.receipt_id, "not_applied", "operator:a", None, NO_WAIT
        )
        assert resolved.status == "reconciled"
        assert await store.complete(admitted.receipt_id, ok()) == "late_outcome"
        receipt = await store.get_receipt(admitted.receipt_id)
        assert (receipt.status, receipt.error) == ("reconciled", "late_outcome")
        # the late answer then breaks on its way to the client: the marker stays
        await store.mark_incomplete(admitted.receipt_id)
        receipt = await store.get_receipt(admitted.receipt_id)
        assert (receipt.status, receipt.error) == ("reconciled", "late_outcome")

    async def test_a_call_settled_while_it_waited_may_not_leave(self, store) -> None:
        """A waiting call's `mark_forwarded` says whether its receipt is still `pending`: one a
        sweep took for lost meanwhile (a peer's, which cannot see it wait) is never sent."""
        waiting = await store.admit(call(1))
        lost = await store.admit(call(1, key="other"))
        assert await store.mark_forwarded(waiting.receipt_id) is True
        await store.expire_pending(NO_WAIT, 60, frozenset({waiting.receipt_id}))
        assert await store.mark_forwarded(lost.receipt_id) is False
        assert (await store.get_receipt(lost.receipt_id)).status == "outcome_unknown"

    async def test_in_flight_receipts_are_not_lost(self, store) -> None:
        admitted = await store.admit(call(1))
        assert await store.expire_pending(NO_WAIT, 60, frozenset({admitted.receipt_id})) == {}
        assert (await store.get_receipt(admitted.receipt_id)).status == "pending"
        # past its grace: only being in flight kept it
        assert await store.expire_pending(NO_WAIT, 60, frozenset()) == {"tool": 1}

    async def test_reject_keeps_a_receipt(self, store) -> None:
        receipt_id = await store.reject(
            Rejection("acct/1", 3, "run-a", None, "tool", "PUT", "/y", "body_too_large", 413)
        )
        receipt = await store.get_receipt(receipt_id)
        assert (receipt.status, receipt.reject_code, receipt.owner) == (
            "rejected",
            "body_too_large",
            "run-a",
        )


class TestLeases:
    """Acquire is a compare-and-swap; fences grow by one per ownership change."""

    async def test_acquire_renew_release(self, store) -> None:
        taken = await store.acquire("r/1", "a", 30, 0, None, None)
        assert (taken.result, taken.lease.fence, taken.lease.state) == ("acquired", 1, "held")
        again = await store.acquire("r/1", "a", 30, 0, None, None)
        assert (again.result, again.lease.owner) == ("held", "a")
        assert (await store.renew("r/1", "a", 1, 60)).fence == 1
        assert await store.renew("r/1", "a", 2, 60) is None
        assert (await store.release("r/1", "a", 1)).ok is True
        second = await store.acquire("r/1", "b", 30, 0, None, None)
        assert second.lease.fence == 2

    async def test_concurrent_acquires_give_one_owner(self, store) -> None:
        results = await asyncio.gather(
            *(store.acquire("r/1", f"w{i}", 30, 0, None, None) for i in range(30))
        )
        assert [r.result for r in results].count("acquired") == 1

    async def test_gateway_issuer_checks(self, store) -> None:
        await store.acquire("r/1", "a", 30, 0, None, None)
        gateway_call = dataclasses.replace(call(1, resource="r/1"), issuer="gateway")
        assert isinstance(await store.admit(gateway_call), Admitted)
        forged = await store.admit(dataclasses.replace(gateway_call, fence=99, idempotency_key="f"))
        assert forged.code == "fence_not_issued"
        mismatch = await store.admit(
            dataclasses.replace(gateway_call, owner="b", idempotency_key="m")
        )
        assert mismatch.code == "owner_mismatch"

    async def test_fence_outlives_accepted_external_tokens(self, store) -> None:
        await store.admit(call(41, resource="r/2"))
        taken = await store.acquire("r/2", "a", 30, 0, None, None)
        assert taken.lease.fence == 42


class TestListing:
    async def test_ids_sort_in_creation_order_and_filter(self, store) -> None:
        for fence in range(1, 31):
            await store.admit(call(fence, key=f"k{fence}", resource=f"a/{fence % 3}"))
        everything = await store.list_receipts(ReceiptQuery(limit=1000))
        assert [r.fence for r in everything.items] == list(range(1, 31))
        first = await store.list_receipts(ReceiptQuery(limit=10))
        assert first.end is not None and [r.fence for r in first.items] == list(range(1, 11))
        page = await store.list_receipts(
            ReceiptQuery(resource="a/1", fence_min=10, limit=3, after=first.end)
        )
        assert [r.fence for r in page.items] == [13, 16, 19]


class TestRetention:
    """Prune deletes what is settled and old, never what a key or a reconciler still needs."""

    async def test_a_key_past_its_retention_is_no_key_before_any_sweep(self, store) -> None:
        """§4: a key is kept for its retention after its receipt completed. Once that has
        passed, the same key is a new call at once, whether retention has swept it or not;
        its receipt, no longer holding a key, goes at the next sweep."""
        brief = dataclasses.replace(call(1, key="brief"), retention_s=1.0)
        first = await store.admit(brief)
        await store.complete(first.receipt_id, ok())
        assert isinstance(await store.admit(brief), Replayed)  # within its retention
        await asyncio.sleep(1.1)
        again = await store.admit(brief)
        assert isinstance(again, Admitted) and again.attempt == 2
        await store.complete(again.receipt_id, ok())
        assert await store.prune(0) == 1  # the first; the second holds the key
        assert await store.get_receipt(first.receipt_id) is None

    async def test_prune(self, store) -> None:
        settled = await store.admit(call(1, key="settled"))
        await store.complete(settled.receipt_id, ok())
        unknown = await store.admit(call(1, key="unknown"))
        await store.expire_pending(NO_WAIT, 60, frozenset())
        rejected = await store.admit(call(1, key="settled", fp="sha256:other"))
        # every receipt is older than a retention of 0 s; the settled key's retention is 60 s
        await asyncio.sleep(0.01)
        assert await store.prune(0) == 1  # only the rejected one: the others hold keys
        assert await store.get_receipt(rejected.receipt_id) is None
        assert await store.get_receipt(settled.receipt_id) is not None
        assert (await store.get_receipt(unknown.receipt_id)).status == "outcome_unknown"
