"""Typed values from any backend's row mapping, and back: receipts, leases, key states, owed
cleanups, stored answers.

Rows come back from SQL as mappings of column names; these are the one place that turns
them into the values of `gateway.core` and `gateway.store.base`, and that turns those values
into what a backend writes (JSON text, parameter tuples), so every backend stores alike.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from json.encoder import encode_basestring_ascii as _json_string
from typing import Any

from gateway.core.cleanups import OwedCleanup
from gateway.core.idempotency import KeyState
from gateway.core.leases import Lease
from gateway.core.mcp import McpRecord
from gateway.core.outcomes import Outcome
from gateway.core.receipts import SETTLED, ReconcileWaits, Resolution, is_lost
from gateway.core.sessions import SessionRecord
from gateway.core.times import rfc3339
from gateway.store.base import CleanupDelay, Receipt, ReceiptQuery, Rejection, Replayed

RECEIPT_COLUMNS = (
    "id",
    "resource",
    "fence",
    "owner",
    "client",
    "upstream",
    "method",
    "path",
    "idempotency_key",
    "fingerprint",
    "attempt",
    "status",
    "http_status",
    "error",
    "reject_code",
    "late",
    "created_at",
    "forwarded_at",
    "completed_at",
    "instance",
    "resolution",
    "kind",
    "session",
    "mcp",
    "trace_id",
)

RECEIPT_SELECT = ", ".join(RECEIPT_COLUMNS)
"""What a receipt read selects: never the stored answers, which can be 64 KiB each."""

SETTLED_SQL = ", ".join(f"'{status}'" for status in sorted(SETTLED))
"""The statuses retention may delete, as an SQL list."""


KEY_STATE_COLUMNS = (
    "id",
    "fingerprint",
    "status",
    "http_status",
    "replayable",
    "resolution",
    "attempt",
    "error",
)
"""What `key_state` reads of the receipt a key points at."""
KEY_STATE_SELECT = ", ".join(f"r.{column}" for column in KEY_STATE_COLUMNS)
"""The same, of a receipt read as `r`."""


def receipt_conditions(
    query: ReceiptQuery, placeholder: Callable[[int], str]
) -> tuple[list[str], list[object]]:
    """A receipt list's filters (all but its position, which each backend orders by its own
    way) as SQL conditions and their parameters, the same on every backend: `placeholder(n)`
    writes the backend's n-th parameter (from 1)."""
    filters = [
        (condition, value)
        for condition, value in (
            ("resource =", query.resource),
            ("status =", query.status),
            ("owner =", query.owner),
            ("idempotency_key =", query.idempotency_key),
            ("fence >=", query.fence_min),
            ("fence <=", query.fence_max),
            ("created_at >=", query.since),
            ("created_at <", query.until),
        )
        if value is not None
    ]
    conditions = [f"{condition} {placeholder(n)}" for n, (condition, _) in enumerate(filters, 1)]
    return conditions, [value for _, value in filters]


def where(conditions: list[str]) -> str:
    return "WHERE " + " AND ".join(conditions) if conditions else ""


def count_by_upstream(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Receipts per upstream (the rows have an `upstream` column)."""
    return dict(Counter(row["upstream"] for row in rows))


def lost_receipts(
    rows: Iterable[Mapping[str, Any]],
    waits: ReconcileWaits,
    silent_after_s: float,
    in_flight: frozenset[str],
    now: float,
    instance: str,
) -> list[Mapping[str, Any]]:
    """The `pending` receipts whose outcome is lost at `now` (`gateway.core.receipts.is_lost`);
    the rows have `id`, `upstream`, `created_at`, `forwarded_at`, `kind`, `instance` and their
    instance's `heartbeat_at`. `instance` is the sweeping one: its own open sessions are in
    `in_flight`, so its own session not in flight has ended, its outcome not recorded; a
    peer's call may still be waiting for older ones to leave (`ReconcileWaits.queued`)."""
    return [
        row
        for row in rows
        if is_lost(
            in_flight_here=row["id"] in in_flight,
            heartbeat_at=row["heartbeat_at"],
            silent_after_s=silent_after_s,
            now=now,
            ready_at=waits.ready_at(row["upstream"], row["forwarded_at"], row["created_at"])
            + (0.0 if row["instance"] == instance else waits.queue_of(row["upstream"])),
            session=row["kind"] == "session" and row["instance"] != instance,
        )
    ]


def receipt_of(row: Mapping[str, Any]) -> Receipt:
    values = {name: row[name] for name in RECEIPT_COLUMNS}
    values["late"] = bool(values["late"])
    for name in ("resolution", "session", "mcp"):
        if isinstance(values[name], str):
            values[name] = json.loads(values[name])
    return Receipt(**values)


def session_json(record: SessionRecord | None) -> str | None:
    """A receipt's `session` column."""
    return json.dumps(record.to_json()) if record is not None else None


def mcp_json(record: McpRecord | None) -> str | None:
    """A receipt's `mcp` column (docs/contract.md §16)."""
    return json.dumps(record.to_json()) if record is not None else None


REJECTED_COLUMNS = (
    "id, resource, fence, owner, client, upstream, method, path, idempotency_key, "
    "fingerprint, status, http_status, reject_code, created_at, completed_at, instance, kind, mcp, "
    "trace_id"
)
"""What a `rejected` receipt is written with; `rejected_values` gives its parameters, the
status being 'rejected' and `completed_at` its `created_at` (the 13th parameter twice)."""


def rejected_values(
    receipt_id: str,
    rejection: Rejection,
    key: str | None,
    fingerprint: str | None,
    now: float | None,
    instance: str,
) -> tuple[Any, ...]:
    """The 17 parameters of a `rejected` receipt's insert (`REJECTED_COLUMNS`)."""
    return (
        receipt_id,
        rejection.resource,
        rejection.fence,
        rejection.owner,
        rejection.client,
        rejection.upstream,
        rejection.method,
        rejection.path,
        key,
        fingerprint,
        rejection.http_status,
        rejection.code,
        now,
        instance,
        rejection.kind,
        mcp_json(rejection.mcp),
        rejection.trace_id,
    )


def outcome_columns(outcome: Outcome) -> tuple[str | None, bytes | None, str | None]:
    """What an outcome stores beside its status: `response_headers` (JSON), `response_body`
    (kept for replay only when whole) and `session`."""
    headers, body = outcome.response if outcome.response is not None else (None, None)
    return (
        headers_json(headers) if headers is not None else None,
        body,
        session_json(outcome.session),
    )


def headers_json(headers: list[tuple[str, str]]) -> str:
    """`json.dumps(headers)`, the same text, written out: most outcomes store headers, and
    `json.dumps` makes a new encoder for every call and marks every pair against cycles."""
    try:
        pairs = [f"[{_json_string(name)}, {_json_string(value)}]" for name, value in headers]
    except (TypeError, ValueError):  # not pairs of strings: as json.dumps makes them
        return json.dumps(headers)
    return f"[{', '.join(pairs)}]"


def replayed_of(receipt_id: str, row: Mapping[str, Any]) -> Replayed:
    """A stored answer (`http_status`, `response_headers`, `response_body`), replayed."""
    return Replayed(
        receipt_id,
        row["http_status"],
        [(name, value) for name, value in json.loads(row["response_headers"])],
        bytes(row["response_body"]),
    )


def resolution_json(outcome: Resolution, source: str, note: str | None, now: float) -> str:
    """A reconciled receipt's `resolution` column (docs/contract.md §7)."""
    return json.dumps({"outcome": outcome, "source": source, "note": note, "at": rfc3339(now)})


def owed_cleanup_rows(
    expired: Iterable[Lease], cleanup_delay: CleanupDelay, now: float
) -> list[tuple[str, int, str, float, float]]:
    """The cleanups expired leases owe, where `cleanup_delay` gives a lock delay: due that
    long after the expiry. Rows of (resource, lease_fence, lease_owner, due_at, created_at)."""
    owed = []
    for lease in expired:
        delay = cleanup_delay(lease.resource, lease.owner)
        if delay is not None:
            owed.append((lease.resource, lease.fence, lease.owner, lease.expires_at + delay, now))
    return owed


LEASE_COLUMNS = (
    "resource",
    "owner",
    "fence",
    "client",
    "acquire_key",
    "state",
    "acquired_at",
    "renewed_at",
    "expires_at",
)
"""What `lease_of` reads of a leases row."""


def lease_of(row: Mapping[str, Any]) -> Lease:
    return Lease(
        resource=row["resource"],
        owner=row["owner"],
        fence=row["fence"],
        state=row["state"],
        client=row["client"],
        acquire_key=row["acquire_key"],
        acquired_at=row["acquired_at"],
        renewed_at=row["renewed_at"],
        expires_at=row["expires_at"],
    )


def key_state(row: Mapping[str, Any]) -> KeyState:
    """The key's latest receipt; its answer is replayable only when stored whole and its body
    did not break afterwards (`error` set)."""
    resolution = row["resolution"]
    if isinstance(resolution, str):
        resolution = json.loads(resolution)
    return KeyState(
        receipt_id=row["id"],
        fingerprint=row["fingerprint"],
        status=row["status"],
        http_status=row["http_status"],
        attempt=row["attempt"],
        resolution=resolution["outcome"] if resolution else None,
        replayable=bool(row["replayable"]) and row["error"] is None,
    )


def owed_cleanup_of(row: Mapping[str, Any]) -> OwedCleanup:
    return OwedCleanup(
        resource=row["resource"],
        lease_fence=row["lease_fence"],
        lease_owner=row["lease_owner"],
        due_at=row["due_at"],
        attempts=row["attempts"],
        sweep_fence=row["sweep_fence"],
        last_error=row["last_error"],
    )
