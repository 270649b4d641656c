"""The gateway's answers as typed values: leases, checkpoints, run views, proxied responses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from multidict import CIMultiDictProxy


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """A lease record as the gateway returned it (docs/contract.md §6)."""

    resource: str
    owner: str
    fence: int
    state: str
    acquired_at: datetime
    renewed_at: datetime | None
    expires_at: datetime

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> LeaseInfo:
        renewed = doc.get("renewed_at")
        return cls(
            resource=doc["resource"],
            owner=doc["owner"],
            fence=int(doc["fence"]),
            state=doc["state"],
            acquired_at=datetime.fromisoformat(doc["acquired_at"]),
            renewed_at=datetime.fromisoformat(renewed) if renewed else None,
            expires_at=datetime.fromisoformat(doc["expires_at"]),
        )

    @property
    def ttl_s(self) -> float:
        """The TTL the gateway granted, from two of its own timestamps, so clock skew cancels."""
        return (self.expires_at - (self.renewed_at or self.acquired_at)).total_seconds()


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A checkpoint as the gateway returned it (docs/contract.md §17)."""

    resource: str
    seq: int
    fence: int
    owner: str | None
    client: str | None
    step: str
    state: Any
    at: datetime

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CheckpointInfo:
        return cls(
            resource=doc["resource"],
            seq=int(doc["seq"]),
            fence=int(doc["fence"]),
            owner=doc.get("owner"),
            client=doc.get("client"),
            step=doc["step"],
            state=doc["state"],
            at=datetime.fromisoformat(doc["at"]),
        )


@dataclass(frozen=True, slots=True)
class RunView:
    """What a replacement worker reads before it resumes a resource's task
    (docs/contract.md §17): the lease, the last checkpoint, and the receipts of the calls
    made since it (as JSON, docs/contract.md §7): `completed` ones, and the ones that
    `needs_confirmation` (in flight, or their outcome was lost) before anything is redone.
    `state`: lease_valid, lease_lost, outcome_unknown, reconciliation_required or idle.
    `highest_fence` is None for an agent (the gateway does not show it to agents)."""

    resource: str
    state: str
    lease: LeaseInfo | None
    highest_fence: int | None
    checkpoint: CheckpointInfo | None
    completed: list[dict[str, Any]]
    needs_confirmation: list[dict[str, Any]]
    rejected: int

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RunView:
        since = doc["since_checkpoint"]
        return cls(
            resource=doc["resource"],
            state=doc["state"],
            lease=LeaseInfo.from_json(doc["lease"]) if doc.get("lease") else None,
            highest_fence=doc.get("highest_fence"),
            checkpoint=CheckpointInfo.from_json(doc["checkpoint"]) if doc["checkpoint"] else None,
            completed=list(since["completed"]),
            needs_confirmation=list(since["needs_confirmation"]),
            rejected=int(since["rejected"]),
        )


@dataclass(frozen=True, slots=True)
class Response:
    """A proxied call's answer, body read completely (so no connection is left half-read)."""

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def receipt_id(self) -> str | None:
        return self.headers.get("X-Receipt-Id")
