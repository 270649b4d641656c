"""The soak's history checker, on small hand-made histories: a clean one passes, and each
invariant is caught by a history that breaks only it."""

from __future__ import annotations

import dataclasses

from tests.soak.history import (
    ACKNOWLEDGED_NOT_SUCCEEDED,
    ADMITTED_AFTER_HIGHER_FENCE,
    FENCE_WENT_DOWN,
    INVARIANTS,
    RECEIPT_PENDING,
    SENT_TWICE,
    SIDE_EFFECT_WITHOUT_RECEIPT,
    Attempt,
    Receipt,
    SideEffect,
    Violation,
    check,
    summary,
)


def attempt(n: int, fence: int, began: float, **kw: object) -> Attempt:
    fields: dict[str, object] = {
        "request_id": f"q{n}",
        "key": f"k{n}",
        "resource": "r",
        "fence": fence,
        "began": began,
        "ended": began + 1,
        "status": 200,
        "receipt_id": f"R{n}",
    }
    fields.update(kw)
    return Attempt(**fields)  # type: ignore[arg-type]


def effect(seq: int, n: int, fence: int, arrived: float, **kw: object) -> SideEffect:
    fields: dict[str, object] = {
        "seq": seq,
        "arrived": arrived,
        "resource": "r",
        "fence": fence,
        "receipt_id": f"R{n}",
        "request_id": f"q{n}",
        "key": f"k{n}",
    }
    fields.update(kw)
    return SideEffect(**fields)  # type: ignore[arg-type]


def receipt(n: int, fence: int, status: str = "succeeded", **kw: object) -> Receipt:
    fields: dict[str, object] = {
        "id": f"R{n}",
        "resource": "r",
        "fence": fence,
        "status": status,
        "idempotency_key": f"k{n}",
    }
    fields.update(kw)
    return Receipt(**fields)  # type: ignore[arg-type]


# A clean history on resource r: the owner of fence 1 calls twice, then fence 2 takes over;
# a stale call with fence 1 that began after fence 2 reached the tool is refused (R4,
# rejected); a call whose gateway died after forwarding it (R5) has no answer and ends
# outcome_unknown; a retry of call 1 is answered from the store (a replay of R1).
CLEAN_ATTEMPTS = [
    attempt(1, 1, began=0.0),
    attempt(2, 1, began=1.0),
    attempt(3, 2, began=3.0),
    attempt(4, 1, began=5.0, status=409, receipt_id="R4", code="stale_fence"),
    attempt(5, 2, began=6.0, status=None, receipt_id=None),
    attempt(6, 1, began=8.0, key="k1", receipt_id="R1", replayed=True),
]
CLEAN_EFFECTS = [
    effect(1, 1, 1, arrived=0.1),
    effect(2, 2, 1, arrived=1.1),
    effect(3, 3, 2, arrived=3.1),
    effect(4, 5, 2, arrived=6.1),
]
CLEAN_RECEIPTS = [
    receipt(1, 1),
    receipt(2, 1),
    receipt(3, 2),
    receipt(4, 1, "rejected", idempotency_key=None),
    receipt(5, 2, "outcome_unknown"),
]


def violations(
    attempts: list[Attempt] = CLEAN_ATTEMPTS,
    effects: list[SideEffect] = CLEAN_EFFECTS,
    receipts: list[Receipt] = CLEAN_RECEIPTS,
) -> list[Violation]:
    return check(attempts, effects, receipts)


def only(found: list[Violation], invariant: str) -> None:
    assert found, "the checker missed it"
    assert {v.invariant for v in found} == {invariant}, [str(v) for v in found]


def replace(items: list, index: int, **changes: object) -> list:  # type: ignore[type-arg]
    return [dataclasses.replace(x, **changes) if i == index else x for i, x in enumerate(items)]


def test_a_clean_history_has_no_violation() -> None:
    assert violations() == []
    assert summary([]) == dict.fromkeys(INVARIANTS, 0)


class TestEverySideEffectHasAReceipt:
    def test_a_side_effect_whose_receipt_the_store_lost(self) -> None:
        # R5: sent, never answered (so no acknowledgement names it), then lost by the store
        only(violations(receipts=CLEAN_RECEIPTS[:4]), SIDE_EFFECT_WITHOUT_RECEIPT)

    def test_a_side_effect_that_came_without_a_receipt_id(self) -> None:
        only(
            violations(effects=replace(CLEAN_EFFECTS, 1, receipt_id=None)),
            SIDE_EFFECT_WITHOUT_RECEIPT,
        )

    def test_a_receipt_that_says_the_call_was_never_sent(self) -> None:
        found = violations(receipts=replace(CLEAN_RECEIPTS, 4, status="not_sent"))
        only(found, SIDE_EFFECT_WITHOUT_RECEIPT)
        assert "not_sent" in found[0].detail

    def test_a_receipt_of_another_fence(self) -> None:
        only(violations(receipts=replace(CLEAN_RECEIPTS, 4, fence=3)), SIDE_EFFECT_WITHOUT_RECEIPT)


def test_a_call_that_reached_the_tool_twice() -> None:
    twice = [*CLEAN_EFFECTS, effect(5, 5, 2, arrived=6.2, request_id="q5-retry")]
    only(violations(effects=twice), SENT_TWICE)


def test_a_receipt_left_pending() -> None:
    found = violations(receipts=replace(CLEAN_RECEIPTS, 4, status="pending"))
    only(found, RECEIPT_PENDING)
    assert "R5" in found[0].detail


class TestEveryAcknowledgedCallSucceeded:
    def test_an_acknowledged_call_whose_receipt_is_not_succeeded(self) -> None:
        only(
            violations(receipts=replace(CLEAN_RECEIPTS, 2, status="outcome_unknown")),
            ACKNOWLEDGED_NOT_SUCCEEDED,
        )

    def test_a_replayed_answer_whose_receipt_failed(self) -> None:
        # only the replay (attempt 6) and the first answer (attempt 1) name R1
        found = violations(receipts=replace(CLEAN_RECEIPTS, 0, status="failed"))
        only(found, ACKNOWLEDGED_NOT_SUCCEEDED)
        assert len(found) == 2

    def test_an_acknowledged_receipt_the_store_does_not_have(self) -> None:
        answered = [*CLEAN_ATTEMPTS, attempt(7, 2, began=9.0, receipt_id="R404")]
        only(violations(attempts=answered), ACKNOWLEDGED_NOT_SUCCEEDED)

    def test_an_answer_the_gateway_said_it_could_not_record_is_not_acknowledged(self) -> None:
        unrecorded = replace(CLEAN_ATTEMPTS, 2, outcome_recorded=False)
        assert (
            violations(unrecorded, receipts=replace(CLEAN_RECEIPTS, 2, status="outcome_unknown"))
            == []
        )


def test_fences_going_down_at_the_tool() -> None:
    # R5 (fence 2) arrives before R3 (fence 2)… fine; an old fence-1 call arriving last is not
    late = [*CLEAN_EFFECTS, effect(5, 8, 1, arrived=6.5)]
    attempts = [*CLEAN_ATTEMPTS, attempt(8, 1, began=2.0, status=None, receipt_id=None)]
    receipts = [*CLEAN_RECEIPTS, receipt(8, 1, "outcome_unknown")]
    found = violations(attempts, late, receipts)
    only(found, FENCE_WENT_DOWN)
    assert "fence 1" in found[0].detail and "after fence 2" in found[0].detail


def test_fences_are_judged_per_resource() -> None:
    other = [*CLEAN_EFFECTS, effect(5, 8, 1, arrived=6.5, resource="s")]
    attempts = [*CLEAN_ATTEMPTS, attempt(8, 1, began=6.4, resource="s")]
    receipts = [*CLEAN_RECEIPTS, receipt(8, 1, resource="s")]
    assert violations(attempts, other, receipts) == []


class TestNoAdmissionAfterAHigherFence:
    def test_a_stale_call_admitted_but_never_sent(self) -> None:
        # R4 began at 5.0, after fence 2 reached the tool at 3.1; it was admitted (then the
        # gateway died before forwarding it): the fence check let it through.
        found = violations(
            receipts=replace(CLEAN_RECEIPTS, 3, status="outcome_unknown", idempotency_key="k4")
        )
        only(found, ADMITTED_AFTER_HIGHER_FENCE)
        assert "R4" in found[0].detail

    def test_a_stale_call_known_only_by_its_key(self) -> None:
        # No answer, never reached the tool: the receipt is found by its idempotency key.
        attempts = [*CLEAN_ATTEMPTS, attempt(9, 1, began=7.0, status=None, receipt_id=None)]
        receipts = [*CLEAN_RECEIPTS, receipt(9, 1, "not_sent")]
        only(violations(attempts, receipts=receipts), ADMITTED_AFTER_HIGHER_FENCE)

    def test_a_stale_call_that_began_before_the_higher_fence_arrived_is_no_violation(self) -> None:
        # Began at 2.0, before fence 2 arrived at 3.1: the gateway may admit it (and must then
        # keep it ahead of fence 2, which the arrival order check covers).
        attempts = [*CLEAN_ATTEMPTS, attempt(9, 1, began=2.0, status=503, code="resource_busy")]
        receipts = [*CLEAN_RECEIPTS, receipt(9, 1, "not_sent")]
        assert violations(attempts, receipts=receipts) == []

    def test_the_exact_attempt_counts_not_the_earliest_with_its_key(self) -> None:
        # Call 9 was first tried at 2.0 (no answer, nothing admitted), retried at 7.0 with the
        # same key and admitted: the tool names the retry's request id.
        attempts = [
            *CLEAN_ATTEMPTS,
            attempt(9, 1, began=2.0, status=None, receipt_id=None),
            attempt(10, 1, began=7.0, key="k9", status=None, receipt_id=None),
        ]
        effects = [*CLEAN_EFFECTS, effect(5, 9, 1, arrived=7.1, request_id="q10")]
        receipts = [*CLEAN_RECEIPTS, receipt(9, 1, "outcome_unknown")]
        found = violations(attempts, effects, receipts)
        assert {v.invariant for v in found} == {ADMITTED_AFTER_HIGHER_FENCE, FENCE_WENT_DOWN}
