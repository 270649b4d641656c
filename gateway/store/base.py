"""The store seam: the `Store` protocol and the typed values that cross it.

A backend implements each method as one atomic transaction in its own SQL. What to write is
decided by the plain functions of `gateway.core` (fences, idempotency, outcomes, leases,
cleanups), so every backend decides alike; the proxy, the upkeep and the API see only this
module. Every method may raise `StoreUnavailable`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Literal, Protocol

from gateway.core.checkpoints import Checkpoint, NewCheckpoint
from gateway.core.cleanups import CleanupClaim, OwedCleanup
from gateway.core.epochs import StoreEpoch
from gateway.core.errors import BY_CODE, StoreUnavailable
from gateway.core.fences import Issuer
from gateway.core.floors import Floors
from gateway.core.leases import Lease, Release
from gateway.core.mcp import McpRecord
from gateway.core.outcomes import Completion, Outcome
from gateway.core.receipts import Kind, ReceiptStatus, ReconcileWaits, Resolution
from gateway.core.sessions import FenceState, SessionRecord
from gateway.core.times import rfc3339

__all__ = [
    "AcquireResult",
    "Admitted",
    "Call",
    "Checkpoint",
    "CheckpointRefused",
    "CheckpointWritten",
    "CleanupClaim",
    "CleanupDelay",
    "Completion",
    "FenceState",
    "Lease",
    "McpRecord",
    "NewCheckpoint",
    "Outcome",
    "OwedCleanup",
    "Receipt",
    "ReceiptQuery",
    "Refused",
    "Rejection",
    "Release",
    "Replayed",
    "ResolveRefused",
    "RestoreReport",
    "RunRecords",
    "SessionRecord",
    "Store",
    "StoreUnavailable",
]


# Not frozen, like the other records a call makes on its way (nothing changes one once it is
# made): a frozen dataclass's __init__ sets each field through object.__setattr__, several
# times the work, and this one is made for every call.
@dataclass(slots=True)
class Call:
    """A fenced call that passed the header checks, as admission needs it. A session's
    upgrade (`kind="session"`, docs/contract.md §15) takes no idempotency key: its key and
    fingerprint are None, and admission skips step 5."""

    resource: str
    fence: int
    owner: str | None  # X-Lease-Owner as presented
    client: str | None
    upstream: str
    method: str
    path: str  # after the mount, with the query
    issuer: Issuer
    idempotency_key: str | None
    fingerprint: str | None
    retry_statuses: frozenset[int]
    retention_s: float
    clients_configured: bool = False
    serial: bool = False  # its rule's `concurrency: serial`: one call at a time
    kind: Kind = "call"
    mcp: McpRecord | None = None  # an MCP tool call's tool and JSON-RPC id (§16)
    trace_id: str | None = None  # the call's sampled trace (docs/contract.md §21)

    def rejection(self, owner: str | None, code: str) -> Rejection:
        """The `rejected` receipt admission keeps when it refuses this call with `code`:
        `owner` as the fence check records it, the error's own status (docs/contract.md §3,
        "Rejected receipts"). Its key and fingerprint are the store's to add, at step 5."""
        return Rejection(
            resource=self.resource,
            fence=self.fence,
            owner=owner,
            client=self.client,
            upstream=self.upstream,
            method=self.method,
            path=self.path,
            code=code,
            http_status=BY_CODE[code].status,
            kind=self.kind,
            mcp=self.mcp,
            trace_id=self.trace_id,
        )


# Not frozen, as Call above.
@dataclass(slots=True)
class Admitted:
    """A `pending` receipt. `instance`: the instance that admitted it, the only one that may
    forward it. `ahead`: calls of the resource that must go first (a lower fence; for a
    serial call, an earlier turn) were still pending when it was admitted, on some other
    process sharing the store; `turn` is its place among the serial calls (docs/contract.md
    §14). A store only one process uses says `ahead=False`: that process's lanes see all."""

    receipt_id: str
    attempt: int | None  # None for a session: it takes no key
    owner: str | None
    instance: str
    ahead: bool = False
    turn: int | None = None


@dataclass(frozen=True, slots=True)
class Replayed:
    receipt_id: str
    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass(frozen=True, slots=True)
class Refused:
    """Admission said no: `code` is an error code; `receipt_id` is the rejected receipt."""

    code: str
    receipt_id: str
    holder_receipt_id: str | None = None  # the receipt an idempotency refusal points at


@dataclass(frozen=True, slots=True)
class Rejection:
    """A call refused before admission (docs/contract.md §3, steps 2 to 3c), kept as a
    `rejected` receipt."""

    resource: str
    fence: int
    owner: str | None
    client: str | None
    upstream: str
    method: str
    path: str
    code: str
    http_status: int
    kind: Kind = "call"
    mcp: McpRecord | None = None
    trace_id: str | None = None


@dataclass(frozen=True, slots=True)
class Receipt:
    """A receipt as stored; `to_json` is the record of docs/contract.md §7."""

    id: str
    resource: str
    fence: int
    owner: str | None
    client: str | None
    upstream: str
    method: str
    path: str
    idempotency_key: str | None
    fingerprint: str | None
    attempt: int | None
    status: ReceiptStatus
    http_status: int | None
    error: str | None
    reject_code: str | None
    late: bool
    created_at: float
    forwarded_at: float | None
    completed_at: float | None
    instance: str
    resolution: dict[str, Any] | None
    kind: Kind = "call"
    session: dict[str, Any] | None = None  # SessionRecord.to_json(), as stored
    mcp: dict[str, Any] | None = None  # McpRecord.to_json(), as stored
    trace_id: str | None = None  # 32 hex digits, when the call's trace was sampled (§21)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "resource": self.resource,
            "fence": self.fence,
            "owner": self.owner,
            "client": self.client,
            "upstream": self.upstream,
            "method": self.method,
            "path": self.path,
            "idempotency_key": self.idempotency_key,
            "fingerprint": self.fingerprint,
            "attempt": self.attempt,
            "status": self.status,
            "http_status": self.http_status,
            "error": self.error,
            "reject_code": self.reject_code,
            "late": self.late,
            "created_at": rfc3339(self.created_at),
            "forwarded_at": rfc3339(self.forwarded_at),
            "completed_at": rfc3339(self.completed_at),
            "instance": self.instance,
            "resolution": self.resolution,
            "kind": self.kind,
            "session": self.session,
            "mcp": self.mcp,
            "trace_id": self.trace_id,
        }


@dataclass(frozen=True, slots=True)
class ReceiptQuery:
    resource: str | None = None
    status: ReceiptStatus | None = None
    owner: str | None = None
    idempotency_key: str | None = None
    fence_min: int | None = None
    fence_max: int | None = None
    since: float | None = None
    until: float | None = None
    after: str | None = None  # a `ReceiptPage.end`: the list goes on after it
    limit: int = 100


@dataclass(frozen=True, slots=True)
class ReceiptPage:
    """Receipts in a list's order, and the position of the last of them (`None` when there
    are none), which a next page's `ReceiptQuery.after` goes on from. The position is the
    store's own: on SQLite the receipt's id, ids being made in the order the writer commits;
    on PostgreSQL the id of the transaction that admitted it, then its id
    (`gateway.store.postgres_lists`)."""

    items: list[Receipt]
    end: str | None


class ResolveRefused(StrEnum):
    """Why `resolve` changed nothing."""

    NOT_FOUND = "not_found"
    NOT_RECONCILABLE = "not_reconcilable"


@dataclass(frozen=True, slots=True)
class AcquireResult:
    """`acquired` (a new fence), `retried` (the same lease again) or `held` (someone's)."""

    result: Literal["acquired", "retried", "held"]
    lease: Lease  # as shown now: the new lease, or the holder's
    held_seconds: float | None  # of a lease taken over before the sweeper marked it


def shown(lease: Lease, now: float) -> Lease:
    """A lease as the API shows it at `now` (the store's clock)."""
    return replace(lease, state=lease.shown(now))


@dataclass(frozen=True, slots=True)
class CheckpointWritten:
    """The checkpoint appended (`created`), or the latest one an identical retry repeats."""

    checkpoint: Checkpoint
    created: bool


@dataclass(frozen=True, slots=True)
class CheckpointRefused:
    """The fence check refused the checkpoint (a §3 step 4 code); nothing was written."""

    code: str


@dataclass(frozen=True, slots=True)
class RunRecords:
    """What the run view of one resource is made of (docs/contract.md §17), read at one
    moment: `now` is the store's clock. `completed` and `needs_confirmation` are the newest
    `RUN_VIEW_LIST_MAX` of the receipts made since the checkpoint, oldest first;
    `unknown_since` is `gateway.core.checkpoints.run_state`'s."""

    lease: Lease | None  # as shown at `now`
    highest_fence: int  # the highest fence issued or accepted
    checkpoint: Checkpoint | None
    completed: list[Receipt]
    needs_confirmation: list[Receipt]
    rejected: int
    unknown_since: dict[str, float]
    now: float


@dataclass(frozen=True, slots=True)
class RestoreReport:
    """What `apply_restore` did (docs/contract.md §18): the highest fence the store knew (or
    the store it replaced, when higher), the floor set above it, the restore epoch now, the
    held leases it expired and the `pending` receipts it turned `outcome_unknown`, by
    upstream."""

    highest: int
    floor: int
    epoch: int
    leases_expired: int
    receipts_unknown: dict[str, int]


CleanupDelay = Callable[[str, str], "float | None"]
"""(resource, owner of the expired lease) → the rule's lock delay when a cleanup is owed."""


@dataclass(frozen=True)
class EpochChange:
    """A new store epoch, recorded (docs/contract.md §19): the one before (None: the store's
    first), the new one, why it is new, and what the §18 floor did (None: not needed)."""

    previous: StoreEpoch | None
    current: StoreEpoch
    reason: str
    floor: RestoreReport | None


class Store(Protocol):
    """What the gateway needs from durable state. Every method may raise StoreUnavailable."""

    recovered: dict[str, int]  # receipts turned outcome_unknown at open, by upstream
    instance: str  # the id this process writes its receipts and heartbeat under, now
    shared: bool  # other processes may admit calls on this store (docs/contract.md §14)
    # Writes commit in the order they were asked for: one asked for before another is durable
    # no later than it (one writer, one queue)
    writes_in_order: bool
    # What `open` found that works but should not be so, for the server to log: (event, detail)
    open_warnings: tuple[tuple[str, str], ...]

    async def open(self) -> None: ...
    async def close(self) -> None: ...

    # calls (docs/contract.md §3, §4)
    async def admit(self, call: Call) -> Admitted | Replayed | Refused:
        """Fence check, fence CAS, key claim and the `pending` receipt: one durable
        transaction."""
        ...

    async def reject(self, rejection: Rejection) -> str:
        """Keep a `rejected` receipt for a call refused before admission; its id."""
        ...

    async def complete(self, receipt_id: str, outcome: Outcome) -> Completion:
        """Record the outcome durably, late outcomes too (`gateway.core.outcomes`)."""
        ...

    async def pending_ahead(self, resource: str, fence: int, turn: int | None) -> bool:
        """Whether calls that must go before an admitted one (`Admitted.ahead`) are still
        pending anywhere."""
        ...

    def may_forward(self, instance: str) -> bool:
        """Whether a call admitted under `instance` may leave now: this process still goes
        by that id and has not lapsed (`gateway.core.liveness`). No I/O: it is asked right
        before the bytes leave."""
        ...

    async def mark_forwarded(self, receipt_id: str) -> bool:
        """A call that waited after admission leaves now (the reconcile grace counts from
        here); False when its receipt is no longer `pending` (a peer's sweep took it for
        lost, or it was reconciled, while it waited): then it must not leave."""
        ...

    async def mark_incomplete(self, receipt_id: str) -> None:
        """The answer's body broke after its outcome was recorded: nothing is replayable. A
        reconciled receipt keeps its `late_outcome` (docs/contract.md §3)."""
        ...

    # sessions (§15)
    async def session_opened(self, receipt_id: str, record: SessionRecord) -> None:
        """A session's upstream WebSocket is open: its `pending` receipt gets `http_status`
        101 and its `session` object."""
        ...

    async def fence_states(self, resources: list[str]) -> dict[str, FenceState]:
        """For resources with open sessions: each one's highest accepted fence and its
        gateway-issued lease, by the store's clock; one read for all of them."""
        ...

    # receipts (§7)
    async def get_receipt(self, receipt_id: str) -> Receipt | None: ...
    async def list_receipts(self, query: ReceiptQuery) -> ReceiptPage:
        """Oldest first; a page read after another from its `end` never skips a receipt and
        never repeats one, also while receipts are being written (docs/contract.md §7)."""
        ...

    async def resolve(
        self,
        receipt_id: str,
        outcome: Resolution,
        source: str,
        note: str | None,
        waits: ReconcileWaits,
    ) -> Receipt | ResolveRefused:
        """Reconcile an `outcome_unknown` receipt past its grace."""
        ...

    async def oldest_unknown_age(self) -> float: ...

    # upkeep (§9)
    async def heartbeat(self) -> None:
        """Refresh this instance's heartbeat: also the write check of readiness. A store
        shared by several processes may refuse it to an instance silent too long; the
        process then goes on under a new `instance` id."""
        ...

    async def expire_pending(
        self, waits: ReconcileWaits, silent_after_s: float, in_flight: frozenset[str]
    ) -> dict[str, int]:
        """Turn lost `pending` receipts `outcome_unknown`; how many, by upstream."""
        ...

    async def prune(self, receipt_retention_s: float) -> int:
        """Delete idempotency keys past retention and completed receipts past theirs."""
        ...

    # leases (§6): the acquire is a compare-and-swap; fences never go back
    async def acquire(
        self,
        resource: str,
        owner: str,
        ttl_s: float,
        lock_delay_s: float,
        client: str | None,
        acquire_key: str | None,
    ) -> AcquireResult: ...
    async def renew(
        self, resource: str, owner: str, fence: int, ttl_s: float, client: str | None = None
    ) -> Lease | None: ...
    async def release(
        self, resource: str, owner: str | None, fence: int | None, client: str | None = None
    ) -> Release: ...
    async def get_lease(self, resource: str) -> Lease | None: ...
    async def list_leases(
        self, prefix: str | None, state: str | None, after: str | None, limit: int
    ) -> list[Lease]: ...

    async def expire_leases(self, cleanup_delay: CleanupDelay | None = None) -> list[Lease]:
        """Mark held leases past expiry `expired`: the ones this call marked, as they were.
        The cleanups they owe (`cleanup_delay`) are written in the same transaction."""
        ...

    # sweeper cleanups (§9): owed in the expiry's transaction, claimed with the CAS
    async def due_cleanups(self, limit: int) -> list[str]: ...
    async def list_cleanups(self) -> list[OwedCleanup]: ...
    async def claim_cleanup(
        self, resource: str, owner: str, ttl_s: float, lock_delay_s: float, recheck_s: float
    ) -> CleanupClaim: ...
    async def finish_cleanup(
        self,
        resource: str,
        fence: int,
        done: bool,
        retry_at: float | None = None,
        error: str | None = None,
    ) -> None: ...
    async def drop_cleanup(self, resource: str) -> None: ...

    # checkpoints and the run view (§17)
    async def write_checkpoint(
        self, new: NewCheckpoint, issuer: Issuer, clients_configured: bool
    ) -> CheckpointWritten | CheckpointRefused:
        """The fence check of §3 step 4 and the append, one durable transaction that moves
        no fence; an identical retry of the latest checkpoint appends nothing
        (`gateway.core.checkpoints.decide_write`)."""
        ...

    async def list_checkpoints(
        self, resource: str, before_seq: int | None, limit: int
    ) -> list[Checkpoint]:
        """A resource's checkpoints, newest first, those below `before_seq` when given."""
        ...

    async def run_records(self, resource: str) -> RunRecords:
        """Everything the run view shows, read in one snapshot."""
        ...

    async def prune_checkpoints(self) -> int:
        """Delete checkpoints past their retention, never a resource's last one."""

    # fence floors (§18): what a restore and an admin's raises add to a resource's fences
    async def raise_fence(self, resource: str, at_least: int) -> int:
        """Raise one resource's highest accepted fence to at least `at_least` (never lower)
        and lift its hold; its highest accepted fence now."""
        ...

    async def raise_fences(self, match: str, at_least: int) -> int:
        """The same for every resource the glob `match` covers, known now or first seen later
        (kept as a rule); how many known resources it covered."""
        ...

    async def apply_restore(self, gap: int, beyond: int = 0) -> RestoreReport:
        """After the store came back from a backup: the store-wide floor at the highest fence
        it knows (or `beyond`, the highest of the store it replaced) plus `gap`, a new restore
        epoch (external resources on hold), every held lease expired now, every `pending`
        receipt `outcome_unknown`; one transaction."""
        ...

    async def highest_fence(self) -> int:
        """The highest fence the store knows: issued, accepted, floor or raise."""
        ...

    async def known_resources(self) -> list[str]:
        """Every resource the store has fences for, in order."""
        ...

    # high availability (§19): a store of one server (SQLite) has no epochs to change
    @property
    def replication_problem(self) -> str | None:
        """Why synchronous replication is not in place now, under `GATEWAY_REPLICATION=sync`
        (None: it is, or the mode does not ask for it); nothing is admitted meanwhile."""
        ...

    def drain_epoch_changes(self) -> list[EpochChange]:
        """The epoch changes this process recorded since it was last asked, oldest first."""
        ...

    async def latest_epoch_change(self) -> EpochChange | None:
        """The store's latest epoch and the one before it (None: it has none)."""
        ...

    async def fence_floors(self) -> Floors:
        """The store-wide fence floors (§18): the floor, the restore epoch, the glob raises."""
        ...
