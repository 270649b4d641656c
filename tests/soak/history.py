"""The history of a soak and the checker that judges it.

A soak records three things: every request a client sent through a gateway (an `Attempt`),
every request the tool received (a `SideEffect`), and, after the run with recovery
completed, every receipt the store API reports (a `Receipt`). `check` is a pure function of
the three: no clock, no I/O, so it can be tested on small hand-made histories
(tests/soak/test_checker.py) before it is trusted with a real one.

All times are `time.monotonic()` of the process that ran the clients and the tool, so the
clients' begin and end times compare directly with the tool's arrival times.

What is proved (docs/contract.md §3, §4, §9, §14):

* every side effect has a receipt, of its resource and fence, that does not deny it was sent;
* each receipt's call reached the tool at most once (§2, "At most once");
* no receipt is left `pending` once recovery has run;
* every acknowledged call's receipt is `succeeded` (acknowledged: the client got the tool's
  2xx answer with an `X-Receipt-Id`, and not `X-Receipt-Outcome: unrecorded`, which is the
  gateway saying it could not record it, §3 "Outcome");
* per resource, in the order the tool received them, fences never go down;
* no call was admitted (its receipt is anything but `rejected`) after the tool had received a
  higher fence for its resource before that call began.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

SIDE_EFFECT_WITHOUT_RECEIPT = "side_effect_without_receipt"
SENT_TWICE = "sent_twice"
RECEIPT_PENDING = "receipt_pending"
ACKNOWLEDGED_NOT_SUCCEEDED = "acknowledged_not_succeeded"
FENCE_WENT_DOWN = "fence_went_down"
ADMITTED_AFTER_HIGHER_FENCE = "admitted_after_higher_fence"

INVARIANTS = (
    SIDE_EFFECT_WITHOUT_RECEIPT,
    SENT_TWICE,
    RECEIPT_PENDING,
    ACKNOWLEDGED_NOT_SUCCEEDED,
    FENCE_WENT_DOWN,
    ADMITTED_AFTER_HIGHER_FENCE,
)

# Statuses that say the call never reached the tool: a side effect under one is a lie.
NEVER_SENT = frozenset({"rejected", "not_sent"})


@dataclasses.dataclass(frozen=True, slots=True)
class Attempt:
    """One request a client sent through a gateway; a retry of the same call (same
    `Idempotency-Key`) is another attempt with its own `X-Request-Id`."""

    request_id: str
    key: str  # Idempotency-Key
    resource: str
    fence: int
    began: float  # before the first byte was sent
    ended: float  # the answer read, or the transport error seen
    status: int | None = None  # None: no answer (connection lost, timed out)
    receipt_id: str | None = None  # the answer's X-Receipt-Id
    replayed: bool = False  # Idempotent-Replayed: true
    outcome_recorded: bool = True  # False: X-Receipt-Outcome: unrecorded
    code: str | None = None  # the gateway's problem code, when it refused

    @property
    def acknowledged(self) -> bool:
        """The client was told the tool did it: the tool's 2xx answer, with its receipt."""
        return (
            self.status is not None
            and 200 <= self.status < 300
            and self.receipt_id is not None
            and self.outcome_recorded
        )


@dataclasses.dataclass(frozen=True, slots=True)
class SideEffect:
    """One request the tool received, with the headers the gateway set on it."""

    seq: int  # arrival order at the tool
    arrived: float
    resource: str | None
    fence: int | None
    receipt_id: str | None
    request_id: str | None
    key: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class Receipt:
    """The fields of a receipt (docs/contract.md §7) the checker reads."""

    id: str
    resource: str
    fence: int
    status: str
    idempotency_key: str | None = None

    @classmethod
    def from_api(cls, doc: Mapping[str, Any]) -> Receipt:
        return cls(
            id=doc["id"],
            resource=doc["resource"],
            fence=int(doc["fence"]),
            status=doc["status"],
            idempotency_key=doc.get("idempotency_key"),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Violation:
    invariant: str  # one of INVARIANTS
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def check(
    attempts: Iterable[Attempt], side_effects: Iterable[SideEffect], receipts: Iterable[Receipt]
) -> list[Violation]:
    """Every violation of the invariants above in this history; empty when it is clean."""
    attempts, side_effects = list(attempts), sorted(side_effects, key=lambda s: s.seq)
    by_id = {r.id: r for r in receipts}
    return [
        *_side_effects_have_receipts(side_effects, by_id),
        *_sent_at_most_once(side_effects),
        *_nothing_pending(by_id.values()),
        *_acknowledged_succeeded(attempts, by_id),
        *_fences_never_go_down(side_effects),
        *_no_admission_after_a_higher_fence(attempts, side_effects, by_id.values()),
    ]


def _side_effects_have_receipts(
    side_effects: list[SideEffect], by_id: Mapping[str, Receipt]
) -> Iterable[Violation]:
    for effect in side_effects:
        receipt = by_id.get(effect.receipt_id or "")
        if receipt is None:
            yield Violation(
                SIDE_EFFECT_WITHOUT_RECEIPT,
                f"the tool's request #{effect.seq} ({effect.resource} fence {effect.fence}) "
                f"names receipt {effect.receipt_id!r}, which the store does not have",
            )
        elif (receipt.resource, receipt.fence) != (effect.resource, effect.fence):
            yield Violation(
                SIDE_EFFECT_WITHOUT_RECEIPT,
                f"the tool's request #{effect.seq} came as {effect.resource} fence "
                f"{effect.fence}; its receipt {receipt.id} says {receipt.resource} fence "
                f"{receipt.fence}",
            )
        elif receipt.status in NEVER_SENT:
            yield Violation(
                SIDE_EFFECT_WITHOUT_RECEIPT,
                f"the tool's request #{effect.seq} ({effect.resource} fence {effect.fence}) "
                f"has receipt {receipt.id}, which says {receipt.status}: never sent",
            )


def _sent_at_most_once(side_effects: list[SideEffect]) -> Iterable[Violation]:
    seen = Counter(e.receipt_id for e in side_effects if e.receipt_id is not None)
    for receipt_id, times in sorted(seen.items()):
        if times > 1:
            yield Violation(SENT_TWICE, f"receipt {receipt_id}'s call reached the tool {times}×")


def _nothing_pending(receipts: Iterable[Receipt]) -> Iterable[Violation]:
    for receipt in receipts:
        if receipt.status == "pending":
            yield Violation(
                RECEIPT_PENDING,
                f"receipt {receipt.id} ({receipt.resource} fence {receipt.fence}) is still "
                "pending after recovery",
            )


def _acknowledged_succeeded(
    attempts: list[Attempt], by_id: Mapping[str, Receipt]
) -> Iterable[Violation]:
    for attempt in attempts:
        if not attempt.acknowledged:
            continue
        receipt = by_id.get(attempt.receipt_id or "")
        if receipt is None or receipt.status != "succeeded":
            said = "no such receipt" if receipt is None else f"it is {receipt.status}"
            yield Violation(
                ACKNOWLEDGED_NOT_SUCCEEDED,
                f"request {attempt.request_id} ({attempt.resource} fence {attempt.fence}) was "
                f"answered {attempt.status} with receipt {attempt.receipt_id}, but {said}",
            )


def _fences_never_go_down(side_effects: list[SideEffect]) -> Iterable[Violation]:
    highest: dict[str | None, SideEffect] = {}
    for effect in side_effects:
        if effect.fence is None:
            continue
        top = highest.get(effect.resource)
        if top is not None and top.fence is not None and effect.fence < top.fence:
            yield Violation(
                FENCE_WENT_DOWN,
                f"{effect.resource}: the tool got fence {effect.fence} (request #{effect.seq}) "
                f"after fence {top.fence} (request #{top.seq})",
            )
        elif top is None or (top.fence or 0) < effect.fence:
            highest[effect.resource] = effect


def _no_admission_after_a_higher_fence(
    attempts: list[Attempt], side_effects: list[SideEffect], receipts: Iterable[Receipt]
) -> Iterable[Violation]:
    """An admitted receipt's call began after the tool had a higher fence of its resource.

    Which attempt made a receipt: the one whose `X-Request-Id` reached the tool with it, else
    the one answered with it as its own (not a replay); else, for a call admitted but never
    answered nor sent, the earliest attempt with its idempotency key, which began no later
    than the real one, so the check can miss a violation there but never invent one.
    """
    began_by_request = {a.request_id: a.began for a in attempts}
    began_by_receipt: dict[str, float] = {}
    for attempt in attempts:
        if attempt.receipt_id is not None and not attempt.replayed:
            began_by_receipt.setdefault(attempt.receipt_id, attempt.began)
    for effect in side_effects:
        began = began_by_request.get(effect.request_id or "")
        if effect.receipt_id is not None and began is not None:
            began_by_receipt[effect.receipt_id] = began
    earliest_by_key: dict[tuple[str, str], float] = {}
    for attempt in attempts:
        slot = (attempt.resource, attempt.key)
        earliest_by_key[slot] = min(earliest_by_key.get(slot, attempt.began), attempt.began)

    # Per resource: arrival times in order, and the highest fence the tool had by each.
    arrivals: dict[str, list[float]] = defaultdict(list)
    highest_by: dict[str, list[tuple[int, int]]] = defaultdict(list)  # (fence, seq)
    for effect in sorted(side_effects, key=lambda e: e.arrived):
        if effect.resource is None or effect.fence is None:
            continue
        top = highest_by[effect.resource][-1] if highest_by[effect.resource] else (0, 0)
        arrivals[effect.resource].append(effect.arrived)
        highest_by[effect.resource].append(max(top, (effect.fence, effect.seq)))

    for receipt in receipts:
        if receipt.status == "rejected":
            continue
        began = began_by_receipt.get(receipt.id)
        if began is None and receipt.idempotency_key is not None:
            began = earliest_by_key.get((receipt.resource, receipt.idempotency_key))
        if began is None:
            continue  # not a call of this history's clients
        seen = bisect.bisect_left(arrivals[receipt.resource], began)
        if seen == 0:
            continue
        fence, seq = highest_by[receipt.resource][seen - 1]
        if fence > receipt.fence:
            yield Violation(
                ADMITTED_AFTER_HIGHER_FENCE,
                f"receipt {receipt.id} ({receipt.resource} fence {receipt.fence}, "
                f"{receipt.status}) was admitted for a call that began after the tool had "
                f"fence {fence} (request #{seq})",
            )


def summary(violations: Iterable[Violation]) -> dict[str, int]:
    """How many violations of each invariant (all of them named, zeros included)."""
    counts = Counter(v.invariant for v in violations)
    return {name: counts.get(name, 0) for name in INVARIANTS}
