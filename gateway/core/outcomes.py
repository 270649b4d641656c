"""Outcomes: what became of a forwarded call, and how one is written onto its receipt.

The table of docs/contract.md §3 ("Outcome") lives in `outcome_of_answer` and in the proxy's
transport errors; `decide_completion` says what an outcome does to a receipt that may already
have been given up on (late outcomes).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from gateway.core.receipts import ReceiptStatus
from gateway.core.sessions import SessionRecord

OutcomeStatus = Literal["succeeded", "failed", "not_sent", "outcome_unknown"]

StoredAnswer = tuple[list[tuple[str, str]], bytes]
"""An answer kept for replay: its headers (hop-by-hop removed) and its whole body."""


# Not frozen, as gateway.store.base.Call says why: one is made for every call.
@dataclass(slots=True)
class Outcome:
    """What became of one forwarded call, as its receipt records it."""

    status: OutcomeStatus
    http_status: int | None = None
    error: str | None = None
    forwarded_at: float | None = None
    response: StoredAnswer | None = None  # kept for replay, only when whole
    session: SessionRecord | None = None  # a session's, when it was opened (§15)

    @property
    def replayable(self) -> bool:
        return self.response is not None


def outcome_of_answer(status: int) -> Literal["succeeded", "failed"]:
    """An answer from the tool: 2xx succeeded, anything else failed."""
    return "succeeded" if 200 <= status < 300 else "failed"


class Completion(StrEnum):
    """What recording an outcome did to its receipt."""

    RECORDED = "recorded"  # a pending receipt got its outcome
    LATE = "late"  # an outcome_unknown receipt learnt it after all (late: true)
    LATE_OUTCOME = "late_outcome"  # the receipt was reconciled already: kept beside, alerted
    UNCHANGED = "unchanged"  # nothing to learn: already final, or a second "unknown"
    MISSING = "missing"  # no such receipt


def decide_completion(current: ReceiptStatus | None, outcome: OutcomeStatus) -> Completion:
    """docs/contract.md §3: an outcome that arrives after its receipt was turned
    `outcome_unknown` is still recorded (late), unless the receipt was already reconciled:
    then the resolution stands and the tool's answer is only kept beside it."""
    if current is None:
        return Completion.MISSING
    late = current in ("outcome_unknown", "reconciled")
    if late and outcome not in ("succeeded", "failed"):
        return Completion.UNCHANGED  # a second "unknown" (or not_sent) teaches nothing
    if current == "reconciled":
        return Completion.LATE_OUTCOME
    if current not in ("pending", "outcome_unknown"):
        return Completion.UNCHANGED  # already final: an outcome is recorded once
    return Completion.LATE if late else Completion.RECORDED


def settles_key(completion: Completion, outcome: OutcomeStatus) -> bool:
    """A key's retention starts once its receipt is settled; unknown holds it for good."""
    return completion in (Completion.RECORDED, Completion.LATE) and outcome != "outcome_unknown"
