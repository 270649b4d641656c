"""The store against a model: a hypothesis state machine drives a real store and a plain
in-memory model of the contract side by side, and after every step compares what the store
holds with what the model says it must hold.

The model is written from docs/contract.md, not from `gateway.core`: §3 (the fence check, its
order and its rejected receipts; outcomes and late outcomes), §4 (the key table, attempts,
retention), §6 (the acquire compare-and-swap, renewal, release and revoke, by the store's
clock), §7 (resolving), §9 (lost calls, retention, recovery at a restart) and §17 (checkpoints:
only the current owner appends, an identical retry appends nothing, retention keeps the last;
the run view). After every step
the store's receipts (every field), leases (as shown), fences (issued and accepted) and keys
(the receipt each points at and its retention) must equal the model's, and these invariants
must hold whatever the model says: a fence is never lowered, an acquire never issues a fence
issued or accepted before, no call is admitted below the highest accepted fence, a key has at
most one live (`pending` or `outcome_unknown`) receipt and points at its latest non-rejected
one, receipt ids grow in creation order, and no `pending` receipt survives recovery.

Both backends run every rule, time-based ones included, on a clock the test moves by hand:
the SQLite store takes a `FakeClock`. The PostgreSQL store takes its time from the database
(`clock_timestamp()`), so its test database gets a `public.clock_timestamp()` that reads the
time from a one-row table, and a `search_path` that puts `public` before `pg_catalog`: the
store's own SQL runs unchanged on the test's clock. Fences and keys are read with plain SQL
beside the store (the `Store` protocol has no read for them).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from gateway.core.checkpoints import NewCheckpoint
from gateway.core.receipts import ReconcileWaits
from gateway.core.times import rfc3339
from gateway.store.base import (
    AcquireResult,
    Admitted,
    Call,
    CheckpointRefused,
    CheckpointWritten,
    Completion,
    Lease,
    Outcome,
    Receipt,
    ReceiptQuery,
    Refused,
    Rejection,
    Replayed,
    ResolveRefused,
    Store,
)
from tests.harness import FakeClock
from tests.store.conftest import BACKENDS, make_store, pg_database

T = TypeVar("T")

START = 1_000.0  # the clock's start, epoch seconds; every step moves it by a whole half second
RESOURCES = {"g/1": "gateway", "g/2": "gateway", "x/1": "external"}  # one issuer per resource
UPSTREAM = {"g/1": "tool", "g/2": "tool", "x/1": "other"}
OWNERS = ("a", "b")
CLIENTS = (None, "c1", "c2")
ACQUIRE_KEYS = (None, "acq-1", "acq-2")
KEYS = ("k1", "k2")
FINGERPRINTS = ("sha256:one", "sha256:two")
RETRY = frozenset({408, 425, 429, 503})
JSON = [("Content-Type", "application/json")]
MISSING_ID = "0" * 26
RESTART_GAP_S = 5.0  # a quick restart; still longer than an instance's silence below
SILENT_AFTER_S = 3.0  # three sweep intervals of 1 s (§9)
PG_HEARTBEAT_LEASE_S = 3.0  # PostgreSQL refuses a heartbeat silent this long (§14)

# §3 and §4: the status of each refusal admission can answer.
REFUSAL_STATUS = {
    "fence_not_issued": 403,
    "not_lease_holder": 403,
    "stale_fence": 409,
    "lease_expired": 409,
    "owner_mismatch": 409,
    "idempotency_in_flight": 409,
    "outcome_unknown": 409,
    "already_completed": 409,
    "idempotency_key_reused": 422,
}

# What became of a forwarded call (§3, "Outcome"); `at` is when it left.
OUTCOMES: dict[str, Callable[[float], Outcome]] = {
    "200 kept": lambda at: Outcome("succeeded", 200, None, at, (JSON, b'{"n": 1}')),
    "201 too large to keep": lambda at: Outcome("succeeded", 201, None, at, None),
    "200 body broke": lambda at: Outcome("succeeded", 200, "response_incomplete", at, None),
    "500 kept": lambda at: Outcome("failed", 500, None, at, (JSON, b'{"e": 1}')),
    "503 retry status": lambda at: Outcome("failed", 503, None, at, (JSON, b"{}")),
    "404 too large to keep": lambda at: Outcome("failed", 404, None, at, None),
    "not sent": lambda at: Outcome("not_sent", None, "upstream_unreachable", None, None),
    "timed out": lambda at: Outcome("outcome_unknown", None, "upstream_timeout", at, None),
}
WAITS = (0.0, 10.0, 1e6)  # an upstream's timeout_s + grace, for resolving and lost calls
# A checkpoint's state: JSON values, two of them equal but for key order (§17).
STATES = ({"a": 1, "b": [1, 2]}, {"b": [1, 2], "a": 1}, {"a": 2}, [1, "x"], None)
STEPS = ("one", "two")
RUN_VIEW_WAITS = ReconcileWaits({"tool": 10.0}, default=1e6)


# ------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------


# the receipts an answer may break for: answered, or reconciled before a late answer
_ANSWERED = ("succeeded", "failed", "reconciled")


@dataclass
class MLease:
    resource: str
    owner: str
    fence: int
    state: str
    client: str | None
    acquire_key: str | None
    acquired_at: float
    renewed_at: float
    expires_at: float

    def live(self, now: float) -> bool:
        return self.state == "held" and now < self.expires_at

    def shown(self, now: float) -> Lease:
        """§6: a lease is expired when now ≥ expires_at, marked or not."""
        state = "expired" if self.state == "held" and now >= self.expires_at else self.state
        return self.as_lease(state)

    def as_lease(self, state: str) -> Lease:
        return Lease(
            self.resource,
            self.owner,
            self.fence,
            state,  # type: ignore[arg-type]
            self.client,
            self.acquire_key,
            self.acquired_at,
            self.renewed_at,
            self.expires_at,
        )


@dataclass
class MReceipt:
    id: str
    resource: str
    fence: int
    owner: str | None
    client: str | None
    upstream: str
    method: str
    path: str
    key: str | None
    fingerprint: str | None
    attempt: int | None
    status: str
    http_status: int | None
    created_at: float
    forwarded_at: float | None
    completed_at: float | None
    instance: str
    error: str | None = None
    reject_code: str | None = None
    late: bool = False
    resolution: dict[str, Any] | None = None
    answer: tuple[list[tuple[str, str]], bytes] | None = None  # kept for replay

    def as_receipt(self) -> Receipt:
        return Receipt(
            id=self.id,
            resource=self.resource,
            fence=self.fence,
            owner=self.owner,
            client=self.client,
            upstream=self.upstream,
            method=self.method,
            path=self.path,
            idempotency_key=self.key,
            fingerprint=self.fingerprint,
            attempt=self.attempt,
            status=self.status,  # type: ignore[arg-type]
            http_status=self.http_status,
            error=self.error,
            reject_code=self.reject_code,
            late=self.late,
            created_at=self.created_at,
            forwarded_at=self.forwarded_at,
            completed_at=self.completed_at,
            instance=self.instance,
            resolution=self.resolution,
        )


@dataclass
class MCheckpoint:
    seq: int
    fence: int
    owner: str | None
    client: str | None
    step: str
    state: Any
    at: float
    retention_s: float
    after_id: str  # the newest receipt id made before it: later ones are "since" it
    expires_at: float | None = None  # None while it is the resource's last

    def shown(self, resource: str) -> tuple[Any, ...]:
        return (resource, self.seq, self.fence, self.owner, self.client, self.step, self.state)


@dataclass
class MKey:
    receipt_id: str
    retention_s: float
    expires_at: float | None = None  # None while its receipt is pending or unknown

    def kept(self, now: float) -> bool:
        """§4: a key is kept for its retention after its receipt completed, and is no key
        from then on, swept or not."""
        return self.expires_at is None or now < self.expires_at


@dataclass(frozen=True)
class NewAttempt:
    """What `Admitted` must say (the store adds what only it knows)."""

    receipt_id: str
    attempt: int | None
    owner: str | None


@dataclass
class Model:
    backend: str
    instance: str
    now: float = START
    issued: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    leases: dict[str, MLease] = field(default_factory=dict)
    receipts: dict[str, MReceipt] = field(default_factory=dict)
    keys: dict[tuple[str, str], MKey] = field(default_factory=dict)
    heartbeats: dict[str, float] = field(default_factory=dict)  # instance → heartbeat_at
    checkpoints: dict[str, list[MCheckpoint]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.heartbeats[self.instance] = self.now

    # -- leases (§6) --------------------------------------------------------------------

    def acquire(
        self,
        resource: str,
        owner: str,
        ttl_s: float,
        lock_delay_s: float,
        client: str | None,
        key: str | None,
    ) -> AcquireResult:
        now, lease = self.now, self.leases.get(resource)
        if lease is not None:
            retried = (
                key is not None
                and (lease.acquire_key, lease.client, lease.owner) == (key, client, owner)
                and lease.live(now)
            )
            if retried:
                return AcquireResult("retried", lease.shown(now), None)
            if lease.state != "released" and now < lease.expires_at + lock_delay_s:
                return AcquireResult("held", lease.shown(now), None)
        # taken over before the sweeper marked it: how long it was held, for the metric
        held = (
            lease.expires_at - lease.acquired_at
            if lease is not None and lease.state == "held"
            else None
        )
        fence = max(self.issued.get(resource, 0), self.accepted.get(resource, 0)) + 1
        self.issued[resource] = fence
        self.leases[resource] = MLease(
            resource, owner, fence, "held", client, key, now, now, now + ttl_s
        )
        return AcquireResult("acquired", self.leases[resource].shown(now), held)

    def renew(
        self, resource: str, owner: str, fence: int, ttl_s: float, client: str | None
    ) -> Lease | None:
        lease = self.leases.get(resource)
        if lease is None or (lease.owner, lease.fence, lease.client) != (owner, fence, client):
            return None
        if not lease.live(self.now):
            return None
        lease.renewed_at, lease.expires_at = self.now, self.now + ttl_s
        return lease.as_lease("held")

    def release(
        self, resource: str, owner: str | None, fence: int | None, client: str | None
    ) -> tuple[bool, float | None]:
        """(204?, held seconds); owner None is an admin's revoke."""
        lease, revoke = self.leases.get(resource), owner is None
        if lease is None:
            return revoke, None
        if not revoke and (lease.owner, lease.fence, lease.client) != (owner, fence, client):
            return False, None
        if lease.state != "held":
            if revoke:
                lease.state = "released"  # the next acquire waits for no lock delay
            return True, None
        if not revoke and self.now >= lease.expires_at:
            return True, None  # expired untaken: the sweeper's to mark
        lease.state = "released"
        return True, min(self.now, lease.expires_at) - lease.acquired_at

    def expire_leases(self) -> list[Lease]:
        marked = []
        for lease in self.leases.values():
            if lease.state == "held" and lease.expires_at <= self.now:
                marked.append(lease.as_lease("held"))
                lease.state = "expired"
        return sorted(marked, key=lambda lease: lease.resource)

    # -- admission (§3 steps 4 to 6, §4) --------------------------------------------------

    def fence_refusal(self, call: Call) -> tuple[str | None, str | None]:
        """Step 4: (refusal or None, the owner the receipt records)."""
        resource, fence = call.resource, call.fence
        if call.issuer == "external":
            return ("stale_fence" if fence < self.accepted.get(resource, 0) else None), call.owner
        lease, issued = self.leases.get(resource), self.issued.get(resource, 0)
        owner = lease.owner if lease is not None and lease.fence == fence else call.owner
        if fence > issued:
            return "fence_not_issued", owner
        if fence < (lease.fence if lease is not None else issued):
            return "stale_fence", owner
        if lease is None or lease.fence != fence:
            return "lease_expired", owner
        if call.clients_configured and call.client != lease.client:
            return "not_lease_holder", owner
        if call.owner is not None and call.owner != lease.owner:
            return "owner_mismatch", owner
        if not lease.live(self.now):
            return "lease_expired", owner
        return None, owner

    def admit(self, call: Call, new_id: str) -> NewAttempt | Replayed | Refused:
        """What admission must answer; a receipt it writes gets the store's id `new_id`."""
        code, owner = self.fence_refusal(call)
        if code is not None:
            self._rejected(new_id, call, owner, code, with_key=False)
            return Refused(code, new_id)
        # Step 6 advances the fence for every call past step 4, whatever step 5 says.
        self.accepted[call.resource] = max(self.accepted.get(call.resource, 0), call.fence)
        key = call.idempotency_key
        assert key is not None
        held = self.keys.get((call.resource, key))
        latest = self.receipts[held.receipt_id] if held and held.kept(self.now) else None
        attempt: int | None = None
        refusal: tuple[str, str | None] | None = None
        if latest is None:  # never used, or pruned: count the attempts still on record
            attempt = 1 + sum(
                1
                for r in self.receipts.values()
                if (r.resource, r.key) == (call.resource, key) and r.status != "rejected"
            )
        elif latest.fingerprint != call.fingerprint:
            refusal = ("idempotency_key_reused", None)
        elif latest.status in ("succeeded", "failed"):
            if latest.status == "failed" and latest.http_status in RETRY:
                attempt = (latest.attempt or 0) + 1
            elif latest.answer is not None and latest.error is None:
                headers, body = latest.answer
                assert latest.http_status is not None
                return Replayed(latest.id, latest.http_status, headers, body)
            else:
                refusal = ("already_completed", latest.id)
        elif latest.status == "pending":
            refusal = ("idempotency_in_flight", latest.id)
        elif latest.status == "outcome_unknown":
            refusal = ("outcome_unknown", latest.id)
        elif latest.status == "reconciled":
            assert latest.resolution is not None
            if latest.resolution["outcome"] == "not_applied":
                attempt = (latest.attempt or 0) + 1
            else:
                refusal = ("already_completed", latest.id)
        else:
            assert latest.status == "not_sent", latest.status
            attempt = (latest.attempt or 0) + 1
        if refusal is not None:
            self._rejected(new_id, call, owner, refusal[0], with_key=True)
            return Refused(refusal[0], new_id, refusal[1])
        assert attempt is not None
        self.receipts[new_id] = MReceipt(
            id=new_id,
            resource=call.resource,
            fence=call.fence,
            owner=owner,
            client=call.client,
            upstream=call.upstream,
            method=call.method,
            path=call.path,
            key=call.idempotency_key,
            fingerprint=call.fingerprint,
            attempt=attempt,
            status="pending",
            http_status=None,
            created_at=self.now,
            forwarded_at=self.now,
            completed_at=None,
            instance=self.instance,
        )
        self.keys[(call.resource, key)] = MKey(new_id, call.retention_s)
        return NewAttempt(new_id, attempt, owner)

    def _rejected(
        self, new_id: str, call: Call, owner: str | None, code: str, *, with_key: bool
    ) -> None:
        self.reject(
            new_id,
            Rejection(
                call.resource,
                call.fence,
                owner,
                call.client,
                call.upstream,
                call.method,
                call.path,
                code,
                REFUSAL_STATUS[code],
            ),
            key=call.idempotency_key if with_key else None,
            fingerprint=call.fingerprint if with_key else None,
        )

    def reject(
        self,
        new_id: str,
        rejection: Rejection,
        *,
        key: str | None = None,
        fingerprint: str | None = None,
    ) -> None:
        self.receipts[new_id] = MReceipt(
            id=new_id,
            resource=rejection.resource,
            fence=rejection.fence,
            owner=rejection.owner,
            client=rejection.client,
            upstream=rejection.upstream,
            method=rejection.method,
            path=rejection.path,
            key=key,
            fingerprint=fingerprint,
            attempt=None,
            status="rejected",
            http_status=rejection.http_status,
            reject_code=rejection.code,
            created_at=self.now,
            forwarded_at=None,
            completed_at=self.now,
            instance=self.instance,
        )

    # -- outcomes (§3) and reconciliation (§7) --------------------------------------------

    def complete(self, receipt_id: str, outcome: Outcome) -> Completion:
        receipt = self.receipts.get(receipt_id)
        if receipt is None:
            return Completion.MISSING
        answered = outcome.status in ("succeeded", "failed")
        if receipt.status == "reconciled" and answered:
            # the resolution stands; the tool's answer is kept beside it, as an alert
            receipt.error, receipt.late, receipt.http_status = (
                "late_outcome",
                True,
                outcome.http_status,
            )
            return Completion.LATE_OUTCOME
        if receipt.status == "pending":
            completion = Completion.RECORDED
        elif receipt.status == "outcome_unknown" and answered:
            completion = Completion.LATE
        else:
            return Completion.UNCHANGED  # an outcome is recorded once
        receipt.status = outcome.status
        receipt.http_status = outcome.http_status
        receipt.error = outcome.error
        receipt.late = completion is Completion.LATE
        # the time it left, as the store took it, stays (an outcome never sent has none)
        if outcome.forwarded_at is None:
            receipt.forwarded_at = None
        elif receipt.forwarded_at is None:
            receipt.forwarded_at = outcome.forwarded_at
        receipt.completed_at = self.now
        receipt.answer = outcome.response
        if outcome.status != "outcome_unknown":
            self._settle_key(receipt)
        return completion

    def _settle_key(self, receipt: MReceipt) -> None:
        """A key's retention starts once the receipt it points at is settled (§4)."""
        assert receipt.key is not None
        held = self.keys.get((receipt.resource, receipt.key))
        if held is not None and held.receipt_id == receipt.id:
            held.expires_at = self.now + held.retention_s

    def mark_forwarded(self, receipt_id: str) -> bool:
        receipt = self.receipts[receipt_id]
        if receipt.status != "pending":
            return False  # settled while it waited: it does not leave
        receipt.forwarded_at = self.now
        return True

    def mark_incomplete(self, receipt_id: str) -> None:
        receipt = self.receipts[receipt_id]
        if receipt.status != "reconciled":  # its late outcome's marker stays
            receipt.error, receipt.answer = "response_incomplete", None

    def resolve(
        self, receipt_id: str, outcome: str, source: str, note: str | None, wait: float
    ) -> MReceipt | ResolveRefused:
        receipt = self.receipts.get(receipt_id)
        if receipt is None:
            return ResolveRefused.NOT_FOUND
        ready_at = (receipt.forwarded_at or receipt.created_at) + wait
        if receipt.status != "outcome_unknown" or self.now < ready_at:
            return ResolveRefused.NOT_RECONCILABLE
        receipt.status = "reconciled"
        receipt.resolution = {
            "outcome": outcome,
            "source": source,
            "note": note,
            "at": rfc3339(self.now),
        }
        if receipt.completed_at is None:
            receipt.completed_at = self.now
        self._settle_key(receipt)
        return receipt

    # -- upkeep (§9) --------------------------------------------------------------------

    def expire_pending(
        self, wait: float, silent_after_s: float, in_flight: frozenset[str], error: str
    ) -> dict[str, int]:
        lost: Counter[str] = Counter()
        for receipt in self.receipts.values():
            if receipt.status != "pending" or receipt.id in in_flight:
                continue
            heartbeat = self.heartbeats.get(receipt.instance)
            ready_at = (
                receipt.forwarded_at if receipt.forwarded_at is not None else receipt.created_at
            ) + wait
            silent = heartbeat is None or heartbeat < self.now - silent_after_s
            if silent or ready_at < self.now:
                receipt.status, receipt.error = "outcome_unknown", error
                lost[receipt.upstream] += 1
        return dict(lost)

    def kept_keys(self) -> dict[tuple[str, str], MKey]:
        return {name: held for name, held in self.keys.items() if held.kept(self.now)}

    def prune(self, retention_s: float) -> int:
        self.keys = self.kept_keys()
        if self.backend == "postgres":
            # A shared store forgets instances silent longer than receipts are kept (§14).
            for instance, beat in list(self.heartbeats.items()):
                if beat < self.now - retention_s:
                    del self.heartbeats[instance]
        holding = {held.receipt_id for held in self.keys.values()}
        doomed = [
            r.id
            for r in self.receipts.values()
            if r.status in ("succeeded", "failed", "not_sent", "rejected", "reconciled")
            and r.completed_at is not None
            and r.completed_at < self.now - retention_s
            and r.id not in holding
        ]
        for receipt_id in doomed:
            del self.receipts[receipt_id]
        return len(doomed)

    # -- checkpoints (§17) ------------------------------------------------------------------

    def write_checkpoint(
        self, call: Call, step: str, state: Any, retention_s: float, after_id: str
    ) -> tuple[str, MCheckpoint | None]:
        """("refused:CODE", None), ("retried", latest) or ("written", new): the fence check
        of a call (§3 step 4), moving no fence."""
        code, owner = self.fence_refusal(call)
        if code is not None:
            return f"refused:{code}", None
        kept = self.checkpoints.setdefault(call.resource, [])
        latest = kept[-1] if kept else None
        if (
            latest is not None
            and (latest.fence, latest.owner, latest.step)
            == (
                call.fence,
                owner,
                step,
            )
            and _canonical(latest.state) == _canonical(state)
        ):
            return "retried", latest
        if latest is not None:
            latest.expires_at = latest.at + latest.retention_s
        checkpoint = MCheckpoint(
            seq=latest.seq + 1 if latest is not None else 1,
            fence=call.fence,
            owner=owner,
            client=call.client,
            step=step,
            state=state,
            at=self.now,
            retention_s=retention_s,
            after_id=after_id,
        )
        kept.append(checkpoint)
        return "written", checkpoint

    def prune_checkpoints(self) -> int:
        pruned = 0
        for kept in self.checkpoints.values():
            keep = [c for c in kept if c.expires_at is None or c.expires_at >= self.now]
            pruned += len(kept) - len(keep)
            kept[:] = keep
        return pruned

    def run_view(self, resource: str) -> dict[str, Any]:
        """What the run view must show of `resource` (§17)."""
        kept = self.checkpoints.get(resource, [])
        latest = kept[-1] if kept else None
        since = [
            r
            for _, r in sorted(self.receipts.items())
            if r.resource == resource and (latest is None or r.id > latest.after_id)
        ]
        completed = ("succeeded", "failed", "not_sent", "reconciled")
        unknown: dict[str, float] = {}
        for r in since:
            if r.status == "outcome_unknown":
                left = r.forwarded_at if r.forwarded_at is not None else r.created_at
                unknown[r.upstream] = min(left, unknown.get(r.upstream, left))
        lease = self.leases.get(resource)
        return {
            "lease": lease.shown(self.now) if lease is not None else None,
            "highest_fence": max(self.issued.get(resource, 0), self.accepted.get(resource, 0)),
            "checkpoint": latest.shown(resource) if latest is not None else None,
            "completed": [r.id for r in since if r.status in completed][-100:],
            "needs_confirmation": [
                r.id for r in since if r.status in ("pending", "outcome_unknown")
            ][-100:],
            "rejected": sum(r.status == "rejected" for r in since),
            "unknown_since": unknown,
        }

    def restart(self, instance: str) -> dict[str, int]:
        """A new process opens the store: on SQLite (one process per file) every `pending`
        receipt is an earlier run's and is lost at once; a shared store leaves them to the
        sweep once their instance has been silent long enough."""
        self.instance = instance
        self.heartbeats[instance] = self.now
        if self.backend != "sqlite":
            return {}
        recovered: Counter[str] = Counter()
        for receipt in self.receipts.values():
            if receipt.status == "pending":
                receipt.status, receipt.error = "outcome_unknown", "gateway_restarted"
                recovered[receipt.upstream] += 1
        return dict(recovered)


def _canonical(state: Any) -> str:
    return json.dumps(state, sort_keys=True, separators=(",", ":"))


# ------------------------------------------------------------------------------------------
# The state machine
# ------------------------------------------------------------------------------------------


class StoreMachine(RuleBasedStateMachine):
    """One example: a fresh store and a fresh model, then rules, each followed by `agrees`."""

    backend: ClassVar[str]
    workdir: ClassVar[Path]
    pg_url: ClassVar[str | None]
    examples: ClassVar[itertools.count[int]]

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.example = next(self.examples)
        self.starts = 0
        self.clock = FakeClock(START)
        self.pg: Any = None
        self.sqlite: sqlite3.Connection | None = None
        self.folder = self.workdir / f"example-{self.example}"
        self.folder.mkdir()
        if self.backend == "postgres":
            self.pg = self.run(_pg_reset(self.pg_url or ""))
        self.store = self.run(self._open())
        self.model = Model(self.backend, self.store.instance)
        if self.backend == "sqlite":
            self.sqlite = sqlite3.connect(f"file:{self.folder / 'gw.db'}?mode=ro", uri=True)
        # history, for the invariants that hold whatever the model says
        self.seen_fences: dict[str, tuple[int, int]] = {}
        self.ever_issued: dict[str, set[int]] = {}
        self.last_id = ""
        self.checks = 0

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    async def _open(self) -> Store:
        self.starts += 1
        instance = f"run-{self.example}-{self.starts}"
        if self.backend == "sqlite":
            store = make_store("sqlite", self.folder, instance=instance, clock=self.clock)
        else:
            store = make_store("postgres", self.workdir, instance=instance)
        await store.open()
        return store

    def teardown(self) -> None:
        try:
            self.run(self.store.close())
            if self.pg is not None:
                self.run(self.pg.close())
            if self.sqlite is not None:
                self.sqlite.close()
        finally:
            self.loop.close()

    def advance(self, seconds: float) -> None:
        self.model.now += seconds
        self.clock.now = self.model.now
        if self.pg is not None:
            self.run(self.pg.execute("UPDATE fake_clock SET now = $1", self.model.now))

    def new_receipt(self, receipt_id: str) -> None:
        """Ids sort in creation order (§7), across restarts too."""
        assert receipt_id > self.last_id, (receipt_id, self.last_id)
        self.last_id = receipt_id

    def pick_receipt(self, data: st.DataObject, *preferred_statuses: str) -> str:
        """Mostly a receipt in one of `preferred_statuses`; sometimes any, or none at all."""
        everything = sorted(self.model.receipts)
        preferred = [i for i in everything if self.model.receipts[i].status in preferred_statuses]
        bucket = data.draw(st.integers(0, 9), label="bucket")
        if bucket == 0 or not everything:
            return MISSING_ID
        if bucket <= 2 or not preferred:
            return data.draw(st.sampled_from(everything), label="any receipt")
        return data.draw(st.sampled_from(preferred), label="receipt")

    def holder_or_other(self, data: st.DataObject, resource: str) -> tuple[str, int, str | None]:
        """(owner, fence, client): mostly the lease's own, sometimes someone else's."""
        lease = self.model.leases.get(resource)
        if lease is not None and data.draw(st.booleans(), label="the holder"):
            return lease.owner, lease.fence, lease.client
        return (
            data.draw(st.sampled_from(OWNERS), label="owner"),
            data.draw(st.integers(1, 6), label="fence"),
            data.draw(st.sampled_from(CLIENTS), label="client"),
        )

    # -- time -------------------------------------------------------------------------------

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.0, 5.0, 10.0, 31.0]), beat=st.booleans())
    def time_passes(self, seconds: float, beat: bool) -> None:
        """Time passes; the process's sweeper heartbeats then, or it was paused."""
        self.advance(seconds)
        if beat:
            self.heartbeat()

    # -- leases -----------------------------------------------------------------------------

    @rule(
        resource=st.sampled_from(sorted(RESOURCES)),
        owner=st.sampled_from(OWNERS),
        ttl_s=st.sampled_from([1.0, 30.0]),
        lock_delay_s=st.sampled_from([0.0, 2.0]),
        client=st.sampled_from(CLIENTS),
        key=st.sampled_from(ACQUIRE_KEYS),
    )
    def acquire(
        self,
        resource: str,
        owner: str,
        ttl_s: float,
        lock_delay_s: float,
        client: str | None,
        key: str | None,
    ) -> None:
        before = max(self.model.issued.get(resource, 0), self.model.accepted.get(resource, 0))
        got = self.run(self.store.acquire(resource, owner, ttl_s, lock_delay_s, client, key))
        assert got == self.model.acquire(resource, owner, ttl_s, lock_delay_s, client, key)
        if got.result == "acquired":  # a fence is never reused
            fence = got.lease.fence
            assert fence > before and fence not in self.ever_issued.setdefault(resource, set())
            self.ever_issued[resource].add(fence)

    @rule(data=st.data(), resource=st.sampled_from(sorted(RESOURCES)))
    def renew(self, data: st.DataObject, resource: str) -> None:
        owner, fence, client = self.holder_or_other(data, resource)
        ttl_s = data.draw(st.sampled_from([1.0, 30.0]), label="ttl_s")
        got = self.run(self.store.renew(resource, owner, fence, ttl_s, client))
        assert got == self.model.renew(resource, owner, fence, ttl_s, client)

    @rule(data=st.data(), resource=st.sampled_from(sorted(RESOURCES)))
    def release(self, data: st.DataObject, resource: str) -> None:
        owner, fence, client = self.holder_or_other(data, resource)
        got = self.run(self.store.release(resource, owner, fence, client))
        assert (got.ok, got.held_seconds) == self.model.release(resource, owner, fence, client)

    @rule(resource=st.sampled_from(sorted(RESOURCES)))
    def revoke(self, resource: str) -> None:
        got = self.run(self.store.release(resource, None, None))
        assert (got.ok, got.held_seconds) == self.model.release(resource, None, None, None)

    @precondition(
        lambda self: any(
            lease.state == "held" and lease.expires_at <= self.model.now
            for lease in self.model.leases.values()
        )
    )
    @rule()
    def expire_leases(self) -> None:
        """The sweeper marks the held leases past their expiry."""
        got = self.run(self.store.expire_leases())
        assert sorted(got, key=lambda lease: lease.resource) == self.model.expire_leases()

    # -- calls ------------------------------------------------------------------------------

    @rule(data=st.data(), resource=st.sampled_from(sorted(RESOURCES)))
    def admit(self, data: st.DataObject, resource: str) -> None:
        """Any token, owner, client and key."""
        model = self.model
        lease = model.leases.get(resource)
        issued, accepted = model.issued.get(resource, 0), model.accepted.get(resource, 0)
        near = {1, issued, issued + 1, accepted, accepted + 1, accepted - 1}
        if lease is not None:
            near |= {lease.fence, lease.fence + 1}
        fence = data.draw(
            st.sampled_from(sorted(f for f in near if f >= 1)) | st.integers(1, 8), label="fence"
        )
        owners = [None, *OWNERS] + ([lease.owner] if lease is not None else [])
        clients = list(CLIENTS) + ([lease.client] if lease is not None else [])
        owner = data.draw(st.sampled_from(owners), label="owner")
        client = data.draw(st.sampled_from(clients), label="client")
        self._admit(data, resource, fence, owner, client)

    @rule(data=st.data())
    def admit_as_holder(self, data: st.DataObject) -> None:
        """The common case: a live lease's holder calls with its fence, owner and client (or
        an external issuer's newest token)."""
        model = self.model
        held = [r for r, lease in sorted(model.leases.items()) if lease.live(model.now)]
        resource = data.draw(st.sampled_from([*held, "x/1"]), label="resource")
        lease = model.leases.get(resource)
        if RESOURCES[resource] == "external" or lease is None:
            self._admit(data, resource, max(1, model.accepted.get(resource, 0)), None, None)
        else:
            self._admit(data, resource, lease.fence, lease.owner, lease.client)

    def _admit(
        self,
        data: st.DataObject,
        resource: str,
        fence: int,
        owner: str | None,
        client: str | None,
    ) -> None:
        model = self.model
        accepted = model.accepted.get(resource, 0)
        call = Call(
            resource=resource,
            fence=fence,
            owner=owner,
            client=client,
            upstream=UPSTREAM[resource],
            method="POST",
            path="/x",
            issuer=RESOURCES[resource],  # type: ignore[arg-type]
            idempotency_key=data.draw(st.sampled_from(KEYS), label="key"),
            fingerprint=data.draw(st.sampled_from(FINGERPRINTS), label="fingerprint"),
            retry_statuses=RETRY,
            retention_s=data.draw(st.sampled_from([5.0, 60.0]), label="retention_s"),
            clients_configured=data.draw(st.booleans(), label="clients configured"),
        )
        got = self.run(self.store.admit(call))
        new_id = got.receipt_id if not isinstance(got, Replayed) else ""
        expected = model.admit(call, new_id)
        if isinstance(got, Admitted):
            assert NewAttempt(got.receipt_id, got.attempt, got.owner) == expected
            assert fence >= accepted  # never admitted below the highest accepted fence
        else:
            assert got == expected
        if not isinstance(got, Replayed):
            self.new_receipt(got.receipt_id)

    @rule(
        resource=st.sampled_from(sorted(RESOURCES)),
        fence=st.integers(1, 6),
        code=st.sampled_from([("body_too_large", 413), ("invalid_request", 400)]),
    )
    def reject(self, resource: str, fence: int, code: tuple[str, int]) -> None:
        """A call refused before admission (§3 steps 2 to 3c) leaves a receipt, moves nothing."""
        rejection = Rejection(resource, fence, "a", None, UPSTREAM[resource], "PUT", "/y", *code)
        receipt_id = self.run(self.store.reject(rejection))
        self.new_receipt(receipt_id)
        self.model.reject(receipt_id, rejection)

    @rule(data=st.data(), outcome=st.sampled_from(sorted(OUTCOMES)))
    def complete(self, data: st.DataObject, outcome: str) -> None:
        receipt_id = self.pick_receipt(data, "pending", "outcome_unknown")
        recorded = OUTCOMES[outcome](self.model.now)
        got = self.run(self.store.complete(receipt_id, recorded))
        assert got == self.model.complete(receipt_id, recorded)

    @precondition(lambda self: any(r.status == "pending" for r in self.model.receipts.values()))
    @rule(data=st.data(), outcome=st.sampled_from(sorted(OUTCOMES)))
    def complete_pending(self, data: st.DataObject, outcome: str) -> None:
        """The common case: a call in flight gets its outcome."""
        pending = sorted(i for i, r in self.model.receipts.items() if r.status == "pending")
        receipt_id = data.draw(st.sampled_from(pending), label="receipt")
        recorded = OUTCOMES[outcome](self.model.now)
        got = self.run(self.store.complete(receipt_id, recorded))
        assert got == self.model.complete(receipt_id, recorded) == Completion.RECORDED

    @precondition(lambda self: any(r.status == "pending" for r in self.model.receipts.values()))
    @rule(data=st.data())
    def mark_forwarded(self, data: st.DataObject) -> None:
        pending = sorted(i for i, r in self.model.receipts.items() if r.status == "pending")
        receipt_id = data.draw(st.sampled_from(pending), label="receipt")
        assert self.run(self.store.mark_forwarded(receipt_id)) == self.model.mark_forwarded(
            receipt_id
        )

    @precondition(lambda self: any(r.status in _ANSWERED for r in self.model.receipts.values()))
    @rule(data=st.data())
    def mark_incomplete(self, data: st.DataObject) -> None:
        """The answer's body broke after its outcome was recorded (a late one, too)."""
        answered = sorted(i for i, r in self.model.receipts.items() if r.status in _ANSWERED)
        receipt_id = data.draw(st.sampled_from(answered), label="receipt")
        self.run(self.store.mark_incomplete(receipt_id))
        self.model.mark_incomplete(receipt_id)

    @rule(
        data=st.data(),
        outcome=st.sampled_from(["applied", "not_applied", "compensated"]),
        wait=st.sampled_from(WAITS),
        note=st.sampled_from([None, "checked the tool"]),
    )
    def resolve(self, data: st.DataObject, outcome: str, wait: float, note: str | None) -> None:
        receipt_id = self.pick_receipt(data, "outcome_unknown")
        waits = ReconcileWaits({}, default=wait)
        got = self.run(self.store.resolve(receipt_id, outcome, "operator:t", note, waits))  # type: ignore[arg-type]
        expected = self.model.resolve(receipt_id, outcome, "operator:t", note, wait)
        if isinstance(expected, MReceipt):
            assert got == expected.as_receipt()
        else:
            assert got == expected

    # -- upkeep -----------------------------------------------------------------------------

    @rule(
        data=st.data(),
        wait=st.sampled_from(WAITS),
        silent_after_s=st.sampled_from([SILENT_AFTER_S, 1e6]),
    )
    def expire_pending(self, data: st.DataObject, wait: float, silent_after_s: float) -> None:
        """The sweeper's lost calls; the ones this process still has in flight are never lost."""
        pending = sorted(i for i, r in self.model.receipts.items() if r.status == "pending")
        in_flight = frozenset(
            data.draw(st.lists(st.sampled_from(pending), unique=True), label="in flight")
            if pending
            else []
        )
        waits = ReconcileWaits({}, default=wait)
        got = self.run(self.store.expire_pending(waits, silent_after_s, in_flight))
        assert got == self.model.expire_pending(
            wait, silent_after_s, in_flight, "outcome_not_recorded"
        )

    def heartbeat(self) -> None:
        before = self.store.instance
        self.run(self.store.heartbeat())
        model = self.model
        silent = model.heartbeats.get(before)
        refused = self.backend == "postgres" and (
            silent is None or silent <= model.now - PG_HEARTBEAT_LEASE_S
        )
        if refused:
            # §14: a shared store refuses the heartbeat of an instance silent that long (its
            # calls may be being recovered); the process goes on under an id never used
            after = self.store.instance
            assert after != before and after not in model.heartbeats
            assert after.startswith(before.split(".")[0])
            model.instance = after
        else:
            assert self.store.instance == before
        model.heartbeats[model.instance] = model.now

    @rule(retention_s=st.sampled_from([0.0, 5.0, 1e6]))
    def prune(self, retention_s: float) -> None:
        assert self.run(self.store.prune(retention_s)) == self.model.prune(retention_s)

    # -- checkpoints (§17) --------------------------------------------------------------------

    @rule(
        data=st.data(),
        resource=st.sampled_from(sorted(RESOURCES)),
        step=st.sampled_from(STEPS),
        state=st.sampled_from(STATES),
        retention_s=st.sampled_from([1.0, 60.0]),
    )
    def write_checkpoint(
        self, data: st.DataObject, resource: str, step: str, state: Any, retention_s: float
    ) -> None:
        """Mostly the holder (or an external issuer's newest token), sometimes anyone."""
        lease = self.model.leases.get(resource)
        if data.draw(st.booleans(), label="the owner"):
            fence = (
                lease.fence
                if RESOURCES[resource] == "gateway" and lease is not None
                else max(1, self.model.accepted.get(resource, 0))
            )
            owner, client = (lease.owner, lease.client) if lease is not None else (None, None)
        else:
            owner, fence, client = self.holder_or_other(data, resource)
        owner = data.draw(st.sampled_from([owner, None]), label="X-Lease-Owner")
        clients_configured = data.draw(st.booleans(), label="clients configured")
        new = NewCheckpoint(
            resource=resource,
            fence=fence,
            owner=owner,
            client=client,
            step=step,
            state=json.dumps(state, separators=(",", ":")),
            retention_s=retention_s,
        )
        got = self.run(
            self.store.write_checkpoint(new, RESOURCES[resource], clients_configured)  # type: ignore[arg-type]
        )
        call = Call(
            resource=resource,
            fence=fence,
            owner=owner,
            client=client,
            upstream=UPSTREAM[resource],
            method="PUT",
            path="",
            issuer=RESOURCES[resource],  # type: ignore[arg-type]
            idempotency_key=None,
            fingerprint=None,
            retry_statuses=RETRY,
            retention_s=retention_s,
            clients_configured=clients_configured,
        )
        result, expected = self.model.write_checkpoint(call, step, state, retention_s, self.last_id)
        if isinstance(got, CheckpointRefused):
            assert (f"refused:{got.code}", None) == (result, expected)
            return
        assert isinstance(got, CheckpointWritten) and expected is not None
        assert ("written" if got.created else "retried") == result
        c = got.checkpoint
        assert (c.resource, c.seq, c.fence, c.owner, c.client, c.step, json.loads(c.state)) == (
            expected.shown(resource)
        )
        assert c.at == expected.at

    @rule()
    def prune_checkpoints(self) -> None:
        assert self.run(self.store.prune_checkpoints()) == self.model.prune_checkpoints()

    @rule(down_s=st.sampled_from([RESTART_GAP_S, 60.0]))
    def restart(self, down_s: float) -> None:
        """The process stops and another starts on the same store; then the sweeper's first
        pass. No `pending` receipt survives it."""
        self.run(self.store.close())
        self.advance(down_s)
        self.store = self.run(self._open())
        assert self.store.recovered == self.model.restart(self.store.instance)
        # new ids sort after every receipt there is (a pruned one may have had a later id)
        self.last_id = max(self.model.receipts, default="")
        never = ReconcileWaits({}, default=1e6)  # only the silence of the old instance counts
        swept = self.run(self.store.expire_pending(never, SILENT_AFTER_S, frozenset()))
        assert swept == self.model.expire_pending(
            1e6, SILENT_AFTER_S, frozenset(), "outcome_not_recorded"
        )
        left = self.run(self.store.list_receipts(ReceiptQuery(status="pending", limit=10_000)))
        assert left.items == []

    # -- after every step ---------------------------------------------------------------------

    @invariant()
    def agrees(self) -> None:
        model, store = self.model, self.store
        receipts = self.run(store.list_receipts(ReceiptQuery(limit=10_000))).items
        assert [r.id for r in receipts] == sorted(model.receipts)
        for receipt in receipts:
            assert receipt == model.receipts[receipt.id].as_receipt()

        leases = self.run(store.list_leases(None, None, None, 100))
        assert leases == [model.leases[r].shown(model.now) for r in sorted(model.leases)]
        self.checks += 1
        state = ("held", "expired", "released")[self.checks % 3]  # one filter a step
        listed = self.run(store.list_leases(None, state, None, 100))
        assert [lease.resource for lease in listed] == [
            lease.resource for lease in leases if lease.state == state
        ]

        fences, keys = self.run(self._fences_and_keys())
        expected_fences = {
            r: (model.issued.get(r, 0), model.accepted.get(r, 0))
            for r in {*model.issued, *model.accepted}
        }
        assert fences == expected_fences
        assert keys == {
            name: (held.receipt_id, held.retention_s, held.expires_at)
            for name, held in model.kept_keys().items()
        }

        self.checkpoint_views()

        # Invariants that hold whatever the model says.
        for resource, (issued, accepted) in fences.items():
            before = self.seen_fences.get(resource, (0, 0))
            assert issued >= before[0] and accepted >= before[1], "a fence went down"
        self.seen_fences = fences
        live = Counter(
            (r.resource, r.idempotency_key)
            for r in receipts
            if r.status in ("pending", "outcome_unknown")
        )
        assert all(count <= 1 for count in live.values()), live
        for (resource, key), (receipt_id, _, _) in keys.items():
            holders = [
                r.id
                for r in receipts
                if (r.resource, r.idempotency_key) == (resource, key) and r.status != "rejected"
            ]
            assert holders and receipt_id == max(holders), (resource, key)

    def checkpoint_views(self) -> None:
        """§17, every other step, one resource at a time: its checkpoints and its run view
        (the reads are what this suite's time goes to)."""
        if self.checks % 2:
            return
        model, store = self.model, self.store
        resource = sorted(RESOURCES)[self.checks // 2 % len(RESOURCES)]
        listed_checkpoints = self.run(store.list_checkpoints(resource, None, 100))
        assert [
            (c.resource, c.seq, c.fence, c.owner, c.client, c.step, json.loads(c.state))
            for c in listed_checkpoints
        ] == [c.shown(resource) for c in reversed(model.checkpoints.get(resource, []))]
        records = self.run(store.run_records(resource))
        shown = records.checkpoint
        assert records.now == model.now
        assert {
            "lease": records.lease,
            "highest_fence": records.highest_fence,
            "checkpoint": None
            if shown is None
            else (
                shown.resource,
                shown.seq,
                shown.fence,
                shown.owner,
                shown.client,
                shown.step,
                json.loads(shown.state),
            ),
            "completed": [r.id for r in records.completed],
            "needs_confirmation": [r.id for r in records.needs_confirmation],
            "rejected": records.rejected,
            "unknown_since": records.unknown_since,
        } == model.run_view(resource)

    async def _fences_and_keys(
        self,
    ) -> tuple[dict[str, tuple[int, int]], dict[tuple[str, str], tuple[str, float, float | None]]]:
        """The fences and the keys kept at the model's now, read with plain SQL beside the
        store: SQLite's view of the keys reads the real clock, so its query is spelled out."""
        fence_sql = "SELECT resource, issued, accepted FROM fences"
        key_sql = "SELECT resource, key, receipt_id, retention_s, expires_at FROM {} "
        kept = "WHERE expires_at IS NULL OR expires_at > {}"
        if self.sqlite is not None:
            fence_rows = self.sqlite.execute(fence_sql).fetchall()
            key_rows = self.sqlite.execute(
                key_sql.format(f"({_SQLITE_KEYS})") + kept.format("?"), (self.model.now,)
            ).fetchall()
        else:
            fence_rows = await self.pg.fetch(fence_sql)
            key_rows = await self.pg.fetch(
                key_sql.format("idempotency_keys") + kept.format("$1"), self.model.now
            )
        fences = {
            row[0]: (row[1], row[2]) for row in fence_rows if (row[1], row[2]) != (0, 0)
        }  # a row of zeros is only the lock of a resource nothing happened to
        keys = {(row[0], row[1]): (row[2], row[3], row[4]) for row in key_rows}
        return fences, keys


# ------------------------------------------------------------------------------------------
# PostgreSQL on the test's clock
# ------------------------------------------------------------------------------------------

_FAKE_CLOCK = """
CREATE TABLE IF NOT EXISTS public.fake_clock (now double precision NOT NULL);
CREATE OR REPLACE FUNCTION public.clock_timestamp() RETURNS timestamptz
    LANGUAGE sql VOLATILE AS $$ SELECT to_timestamp(now) FROM public.fake_clock $$;
"""
_TABLES = (
    "fences",
    "leases",
    "receipts",
    "idempotency_keys",
    "instances",
    "cleanups",
    "checkpoints",
)


# SQLite's keys: each key's latest receipt not rejected that holds one (schema 8), whenever
# it expires (the view `idempotency_keys` leaves out those expired by the real clock).
_SQLITE_KEYS = (
    "SELECT r.resource, r.idempotency_key AS key, r.id AS receipt_id, "
    "r.key_retention_s AS retention_s, r.key_expires_at AS expires_at FROM receipts r "
    "WHERE r.key_retention_s IS NOT NULL AND r.id = (SELECT max(p.id) FROM receipts p "
    "WHERE p.idempotency_key = r.idempotency_key AND p.resource = r.resource "
    "AND p.status != 'rejected')"
)


async def _pg_install_clock(url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(_FAKE_CLOCK)
        name = await conn.fetchval("SELECT current_database()")
        # pg_catalog last: the clock_timestamp() above is found before the built-in one
        await conn.execute(f'ALTER DATABASE {name} SET search_path = "$user", public, pg_catalog')
    finally:
        await conn.close()


async def _pg_reset(url: str) -> Any:
    """Empty the store's tables (a fresh store for each example) and set the clock back; the
    connection stays open for the machine's clock and reads."""
    import asyncpg

    conn = await asyncpg.connect(url)
    async with conn.transaction():  # DELETE: for a few rows, much quicker than TRUNCATE
        for table in _TABLES:
            if await conn.fetchval("SELECT to_regclass($1)", table):
                await conn.execute(f"DELETE FROM {table}")
        await conn.execute("DELETE FROM fake_clock")
        await conn.execute("INSERT INTO fake_clock (now) VALUES ($1)", START)
    return conn


# ------------------------------------------------------------------------------------------
# The test
# ------------------------------------------------------------------------------------------

SETTINGS = settings(
    max_examples=25,
    stateful_step_count=50,
    deadline=None,
    database=None,  # nothing written into the working tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_store_agrees_with_its_model(backend: str, tmp_path: Path) -> None:
    pg_url = None
    if backend == "postgres":
        pg_url = pg_database(tmp_path)  # skips, or fails on CI, when PostgreSQL is away
        asyncio.run(_pg_install_clock(pg_url))
    machine = type(
        f"StoreMachine_{backend}",
        (StoreMachine,),
        {"backend": backend, "workdir": tmp_path, "pg_url": pg_url, "examples": itertools.count()},
    )
    run_state_machine_as_test(machine, settings=SETTINGS)
