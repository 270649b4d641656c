"""Idempotency (docs/contract.md §4): keys, fingerprints, and what a key's state answers.

`decide` is the §4 table as a function: the store reads the latest non-rejected receipt that
holds the key inside its admission transaction, asks it, and writes what it decides.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from gateway.core.receipts import ReceiptStatus, Resolution


@dataclass(frozen=True, slots=True)
class KeyState:
    """The latest non-rejected receipt that holds an idempotency key."""

    receipt_id: str
    fingerprint: str
    status: ReceiptStatus
    http_status: int | None
    replayable: bool  # its whole answer is stored and its body did not break
    resolution: Resolution | None
    attempt: int


@dataclass(frozen=True, slots=True)
class NewAttempt:
    attempt: int


@dataclass(frozen=True, slots=True)
class Replay:
    receipt_id: str


@dataclass(frozen=True, slots=True)
class Refuse:
    code: str
    receipt_id: str | None  # the receipt the refusal points at (`receipt_id` of the problem)


Decision = NewAttempt | Replay | Refuse


def decide(
    latest: KeyState | None,
    fingerprint: str,
    retry_statuses: frozenset[int],
    pruned_attempts: int = 0,
) -> Decision:
    """What a call with a key whose latest receipt is `latest` gets.

    `pruned_attempts`: with no key record (never used, or pruned after its retention), the
    number of earlier non-rejected receipts that sent this key: `attempt` counts them too.
    """
    if latest is None:
        return NewAttempt(1 + pruned_attempts)
    if latest.fingerprint != fingerprint:
        return Refuse("idempotency_key_reused", None)
    again = NewAttempt(latest.attempt + 1)
    status = latest.status
    if status in ("succeeded", "failed"):
        if status == "failed" and latest.http_status in retry_statuses:
            return again
        if latest.replayable:
            return Replay(latest.receipt_id)
        return Refuse("already_completed", latest.receipt_id)
    if status == "pending":
        return Refuse("idempotency_in_flight", latest.receipt_id)
    if status == "outcome_unknown":
        return Refuse("outcome_unknown", latest.receipt_id)
    if status == "reconciled":
        if latest.resolution == "not_applied":
            return again
        return Refuse("already_completed", latest.receipt_id)
    if status == "not_sent":
        return again
    raise ValueError(f"a key cannot be held by a {status!r} receipt")


def fingerprint(method: str, target: str, body: bytes) -> str:
    digest = hashlib.sha256(f"{method}\n{target}\n".encode() + body)
    return "sha256:" + digest.hexdigest()


def derived_key(resource: str, method: str, target: str, body: bytes) -> str:
    digest = hashlib.sha256(f"{resource}\n{method}\n{target}\n".encode() + body)
    return "gw-" + digest.hexdigest()[:32]


def random_key() -> str:
    return "gw-" + secrets.token_hex(16)


def sweep_key(fence: int) -> str:
    """The key of the sweeper's cleanup call under its lease `fence` (docs/contract.md §9)."""
    return f"gw-sweep-{fence}"
