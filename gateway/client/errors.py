"""The client library's errors, and the reading of a gateway's problem+json answer into them.

    GatewayError(status, code, detail, problem)   status is None when raised locally
    ├── LeaseHeld    409 lease_held: someone else holds the resource (holder, retry_after)
    └── LeaseLost    the lease is gone: renewal refused, local deadline passed, or a fenced
                     call was refused as stale_fence / lease_expired / owner_mismatch / ...

Both clients (aiohttp and the synchronous one) read answers with these functions, so one
answer means one exception whichever client received it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

# Gateway answers to a fenced call that mean this lease can no longer act.
LOST_CODES = frozenset(
    {"stale_fence", "lease_expired", "owner_mismatch", "not_lease_holder", "lease_lost"}
)


class GatewayError(Exception):
    """A problem+json answer of the gateway, or a refusal raised locally (status None)."""

    def __init__(
        self,
        status: int | None,
        code: str,
        detail: str,
        problem: dict[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{code}: {detail}" if status is None else f"{status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail
        self.problem: dict[str, Any] = problem or {}
        self.retry_after = retry_after  # seconds, from the Retry-After header when sent

    @property
    def is_refusal(self) -> bool:
        """A definite answer (a 4xx, or raised locally): sending it again cannot help. A 5xx
        (the store unavailable, the gateway draining), a 408 (the request came too slowly)
        and a 429 (too many requests, from a proxy on the way) may pass on a later try."""
        return self.status is None or (self.status < 500 and self.status not in _TRANSIENT)


_TRANSIENT = frozenset({408, 429})


class LeaseHeld(GatewayError):
    """The resource is leased by someone else; `holder` and `retry_after` say who and how long."""

    @property
    def holder(self) -> str | None:
        return self.problem.get("holder")


class LeaseLost(GatewayError):
    """This lease can no longer act; every later fenced call raises it before sending."""


def _retry_after(headers: Mapping[str, str]) -> float | None:
    try:
        return max(float(headers["Retry-After"]), 0.0)
    except (KeyError, ValueError):  # absent, or an HTTP-date: the gateway itself sends seconds
        return None


def error_from(status: int, headers: Mapping[str, str], body: bytes) -> GatewayError:
    """The exception for a problem+json answer; LeaseHeld and LeaseLost by their codes."""
    try:
        problem = json.loads(body) if body else {}
    except ValueError:
        problem = {}
    if not isinstance(problem, dict):
        problem = {}
    code = str(problem.get("code", f"http_{status}"))
    detail = str(problem.get("detail", body[:200].decode("utf-8", "replace")))
    cls = LeaseHeld if code == "lease_held" else LeaseLost if code in LOST_CODES else GatewayError
    return cls(status, code, detail, problem, _retry_after(headers))


def is_gateway_problem(headers: Mapping[str, str], body: bytes) -> bool:
    """A proxied answer the gateway wrote itself, not an upstream's own error."""
    if not headers.get("Content-Type", "").startswith("application/problem+json"):
        return False
    with contextlib.suppress(ValueError, AttributeError):
        return str(json.loads(body).get("type", "")).startswith("urn:fence-gateway:")
    return False
