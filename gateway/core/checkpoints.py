"""Checkpoints and the run view (docs/contract.md §17), decided.

A checkpoint records where the owner of a resource had got to in a long task. Only the
current owner writes one (the fence check of §3, step 4, run in the store's transaction), a
retry of the same write appends nothing, and the run view tells a replacement worker which of
the calls made since the last checkpoint completed and which need confirmation. Plain
functions on plain values: every store decides alike.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal, get_args

from gateway.core import fences, floors
from gateway.core.fences import Issuer, LeaseView
from gateway.core.receipts import ReceiptStatus, ReconcileWaits, may_resolve
from gateway.core.times import rfc3339

MAX_STEP = 128
MAX_STATE_BYTES = 65536  # `state` as compact JSON, UTF-8
MAX_BODY_BYTES = 131072  # the endpoint's body limit
RUN_VIEW_LIST_MAX = 100  # of each list of `since_checkpoint`, the newest this many

# A step is a label a person reads in a run view and a log: no control characters, which
# would corrupt a terminal or a log line (and NUL cannot be PostgreSQL text).
STEP_PATTERN = rf"^[^\x00-\x1f\x7f-\x9f]{{1,{MAX_STEP}}}$"
_STEP = re.compile(STEP_PATTERN)
# JSON's \u escapes can carry half of a surrogate pair, which is no character at all and
# cannot be stored as UTF-8.
_UNPAIRED_SURROGATE = re.compile("[\ud800-\udfff]")


class BadCheckpoint(ValueError):
    """The step or the state is not one the gateway keeps (`400 invalid_request`)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint as stored; `state` is its compact JSON text, as the owner sent it."""

    resource: str
    seq: int
    fence: int
    owner: str | None
    client: str | None
    step: str
    state: str
    at: float
    # Where it falls among the resource's receipts: a position in receipt-id order, made by
    # the store when it was written (`gateway.store.checkpoint_rows.since`). Not shown.
    mark: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "seq": self.seq,
            "fence": self.fence,
            "owner": self.owner,
            "client": self.client,
            "step": self.step,
            "state": json.loads(self.state),
            "at": rfc3339(self.at),
        }


@dataclass(frozen=True, slots=True)
class NewCheckpoint:
    """A checkpoint an owner asks to write: checked (`checked_step`, `encoded_state`)."""

    resource: str
    fence: int
    owner: str | None  # X-Lease-Owner as presented
    client: str | None
    step: str
    state: str  # compact JSON
    retention_s: float


def checked_step(step: str) -> str:
    if _STEP.fullmatch(step) is None or _UNPAIRED_SURROGATE.search(step):
        raise BadCheckpoint(
            f"step: 1 to {MAX_STEP} characters, no control characters or unpaired surrogates"
        )
    return step


def encoded_state(state: Any) -> str:
    """`state` as compact JSON, the form it is measured and kept in; BadCheckpoint when it is
    not JSON the gateway can keep (NaN, an unpaired surrogate) or too large."""
    try:
        text = json.dumps(state, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        size = len(text.encode("utf-8"))
    except (ValueError, RecursionError, UnicodeEncodeError):
        raise BadCheckpoint(
            "state: JSON without NaN, Infinity or unpaired surrogates, not nested too deeply"
        ) from None
    if size > MAX_STATE_BYTES:
        raise BadCheckpoint(f"state is {size} bytes as compact JSON; at most {MAX_STATE_BYTES}")
    return text


def same_state(a: str, b: str) -> bool:
    """Whether two encoded states are equal as JSON, key order aside: numbers by their
    exact value however they were written (`1e31` is `10000000000000000000000000000000`,
    `1.0` is `1`), and never equal to `true` or `false`."""
    exact_a = _exact(json.loads(a, parse_float=Decimal, parse_int=Decimal))
    return bool(exact_a == _exact(json.loads(b, parse_float=Decimal, parse_int=Decimal)))


def _exact(value: Any) -> Any:
    """A parsed state with its numbers tagged: dicts compare without their order, Decimals
    by value, and a tagged number never equals a bool (Decimal(1) == True)."""
    if isinstance(value, Decimal):
        return ("number", value)
    if isinstance(value, list):
        return [_exact(item) for item in value]
    if isinstance(value, dict):
        return {name: _exact(item) for name, item in value.items()}
    return value


def is_retry(latest: Checkpoint | None, new: NewCheckpoint, owner: str | None) -> bool:
    """An identical retry of the resource's latest checkpoint: same fence, owner (as the
    fence check records it), step, and state equal as JSON. It is answered with that
    checkpoint and appends nothing. Only the latest counts: writing an earlier step again
    later is a new checkpoint, the owner's position now."""
    return (
        latest is not None
        and latest.fence == new.fence
        and latest.owner == owner
        and latest.step == new.step
        and same_state(latest.state, new.state)
    )


# -- the run view ----------------------------------------------------------------------------

Group = Literal["completed", "needs_confirmation", "rejected"]

COMPLETED: frozenset[ReceiptStatus] = frozenset({"succeeded", "failed", "not_sent", "reconciled"})
NEEDS_CONFIRMATION: frozenset[ReceiptStatus] = frozenset({"pending", "outcome_unknown"})


def group_of(status: ReceiptStatus) -> Group:
    """Where a receipt made since the last checkpoint goes in the run view."""
    if status in COMPLETED:
        return "completed"
    if status in NEEDS_CONFIRMATION:
        return "needs_confirmation"
    return "rejected"


def statuses_of(group: Group) -> tuple[ReceiptStatus, ...]:
    """The statuses of a group, for a store's query."""
    return tuple(s for s in get_args(ReceiptStatus) if group_of(s) == group)


RunState = Literal[
    "lease_valid", "lease_lost", "outcome_unknown", "reconciliation_required", "idle"
]


def run_state(
    unknown_since: dict[str, float],
    lease_exists: bool,
    lease_live: bool,
    waits: ReconcileWaits,
    now: float,
) -> RunState:
    """The run view's `state`. `unknown_since`: for each upstream with `outcome_unknown`
    receipts made since the last checkpoint, the earliest time one of them left (its
    `forwarded_at`, else `created_at`); past that plus the upstream's wait, one of them may
    be reconciled."""
    if any(
        may_resolve("outcome_unknown", left + waits.of(upstream), now)
        for upstream, left in unknown_since.items()
    ):
        return "reconciliation_required"
    if unknown_since:
        return "outcome_unknown"
    if lease_live:
        return "lease_valid"
    if lease_exists:
        return "lease_lost"
    return "idle"


# -- writing, decided ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Append:
    """Append the checkpoint as `seq`, recording `owner` (as the fence check records it)."""

    seq: int
    owner: str | None

    def checkpoint(self, new: NewCheckpoint, at: float, mark: str) -> Checkpoint:
        """The checkpoint to append, written at `at` (the store's clock) with `mark`, its
        place in receipt-id order."""
        return Checkpoint(
            new.resource, self.seq, new.fence, self.owner, new.client, new.step, new.state, at, mark
        )


@dataclass(frozen=True, slots=True)
class Retry:
    """An identical retry: answer `latest` (`200`), append nothing."""

    latest: Checkpoint


@dataclass(frozen=True, slots=True)
class Refuse:
    """The authority check said no: write nothing."""

    code: str


WriteDecision = Append | Retry | Refuse


def decide_write(
    issuer: Issuer,
    new: NewCheckpoint,
    row: floors.FenceRow,
    known: floors.Floors,
    lease: LeaseView | None,
    latest: Checkpoint | None,
    clients_configured: bool,
) -> WriteDecision:
    """§3 step 4 for the checkpoint's fence, with the floors a restore and an admin's raises
    add (§18) as for a call; then retry or append. A checkpoint moves no fence; `seq` counts
    on from the latest, which retention never deletes, so it is never reused."""
    code, owner = fences.check(
        issuer,
        new.fence,
        row.issued,
        floors.accepted(known, new.resource, row),
        lease,
        new.owner,
        new.client,
        clients_configured,
        floors.bound(known, new.resource, issuer, row),
    )
    if code is not None:
        return Refuse(code)
    if latest is not None and is_retry(latest, new, owner):
        return Retry(latest)
    return Append(latest.seq + 1 if latest is not None else 1, owner)
