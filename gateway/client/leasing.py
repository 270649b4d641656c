"""What both clients decide the same way, with no I/O: the lease API calls they send, how a
lease's local deadline and loss are kept, when to retry an acquire and when to renew.

`GatewayClient` (aiohttp) and `SyncGatewayClient` (the standard library, a thread) differ only
in how they send and wait; everything here is shared, so the two cannot drift apart.

Deadlines are kept on the local monotonic clock, conservatively: a lease's local deadline is
the moment its acquire (or last successful renewal) was *sent* plus its TTL, which is never
later than the gateway's own expiry. The gateway's fence check stays the real guard; the local
check only spares it calls that are certain to be refused.
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

from .errors import GatewayError, LeaseHeld, LeaseLost
from .fencing import FencedAuth, fenced_headers, mcp_meta
from .records import LeaseInfo

API = "/_gateway/v1"
RENEW_FRACTION = 1 / 3  # renew at about a third of the TTL: two more chances before expiry
RENEW_JITTER = 0.15  # ± this fraction, so thousands of workers do not renew together


def renew_delay(ttl_s: float, rng: random.Random | None = None) -> float:
    """Seconds until the next renewal: a third of the TTL, ± RENEW_JITTER of it."""
    jitter = (rng or random).uniform(-RENEW_JITTER, RENEW_JITTER)
    return ttl_s * RENEW_FRACTION * (1 + jitter)


def quoted(resource: str) -> str:
    return quote(resource, safe="/:@")


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One call of /_gateway/v1, as either client sends it."""

    method: str
    path: str  # under API
    body: Any = None
    params: dict[str, str] | None = None
    headers: dict[str, str] = field(default_factory=dict)


def acquire_call(resource: str, owner: str, ttl_s: float | None, key: str | None) -> ApiCall:
    body: dict[str, Any] = {"owner": owner}
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    headers = {"Idempotency-Key": key} if key else {}
    return ApiCall("POST", "/leases/" + quoted(resource), body, headers=headers)


def renew_call(resource: str, owner: str, fence: int, ttl_s: float | None) -> ApiCall:
    body: dict[str, Any] = {"owner": owner, "fence": fence}
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    return ApiCall("PUT", "/leases/" + quoted(resource), body)


def release_call(resource: str, owner: str, fence: int) -> ApiCall:
    params = {"owner": owner, "fence": str(fence)}
    return ApiCall("DELETE", "/leases/" + quoted(resource), params=params)


def lease_call(resource: str) -> ApiCall:
    return ApiCall("GET", "/leases/" + quoted(resource))


def resume_call(resource: str) -> ApiCall:
    return ApiCall("GET", "/resources/" + quoted(resource))


def checkpoint_call(
    resource: str,
    fence: int,
    step: str,
    state: Any,
    owner: str | None = None,
    signature: str | None = None,
) -> ApiCall:
    headers = {"X-Fence-Token": str(fence)}
    if owner is not None:
        headers["X-Lease-Owner"] = owner
    if signature is not None:
        headers["X-Fence-Signature"] = signature
    body = {"step": step, "state": state}
    return ApiCall("PUT", "/checkpoints/" + quoted(resource), body, headers=headers)


def checkpoints_call(resource: str, limit: int, cursor: str | None) -> ApiCall:
    params = {"limit": str(limit), **({"cursor": cursor} if cursor else {})}
    return ApiCall("GET", "/checkpoints/" + quoted(resource), params=params)


def checkpoint_retry_wait(exc: Exception, attempt: int, attempts: int) -> float:
    """Seconds before checkpoint attempt `attempt + 1` after `exc`; `exc` itself when a refusal
    or the last attempt (an identical retry appends nothing, so a lost answer is resent)."""
    if (isinstance(exc, GatewayError) and exc.is_refusal) or attempt >= attempts:
        raise exc
    return float(0.1 * 2**attempt * random.uniform(0.5, 1.0))


class AcquireAttempts:
    """The polite retries of one acquire: the client sends, this decides.

    One Idempotency-Key per attempt, reused when the answer was lost in transit so the retry
    returns the same lease; a fresh key after a definite lease_held answer. `held` and
    `failed` give the seconds to wait, or raise the failure once `timeout_s` has passed.
    """

    def __init__(self, timeout_s: float) -> None:
        self._give_up = time.monotonic() + timeout_s
        self.key = uuid.uuid4().hex
        self.first_sent: float | None = None
        self._failures = 0

    def sending(self) -> str:
        """The key to send now; a retried key's lease dates from that key's first send."""
        if self.first_sent is None:
            self.first_sent = time.monotonic()
        return self.key

    def held(self, exc: LeaseHeld) -> float:
        self.key, self.first_sent = uuid.uuid4().hex, None
        return self._wait(exc, (exc.retry_after or 1.0) * random.uniform(1.0, 1.25))

    def failed(self, exc: Exception) -> float:
        """After a transport error or a gateway answer other than lease_held."""
        if isinstance(exc, GatewayError) and exc.is_refusal:
            raise exc  # a bad ttl, a resource not allowed: retrying cannot help
        self._failures += 1
        return self._wait(exc, min(0.1 * 2**self._failures, 2.0) * random.uniform(0.5, 1.0))

    def _wait(self, exc: Exception, wait: float) -> float:
        remaining = self._give_up - time.monotonic()
        if remaining <= 0:
            raise exc
        return min(wait, remaining)


class LeaseState:
    """A held lease as both clients' `Lease` see it: its record, its local deadline, whether
    and why it is lost, and everything a fenced call takes from it (headers, `_meta`, `auth=`).

    Written by the renewal (a task, or a thread in the synchronous client) and read by the
    caller: each write replaces whole values, and a lease once lost stays lost.
    """

    def __init__(
        self,
        resource: str,
        owner: str,
        ttl_s: float | None,
        *,
        gateway: str,
        proxy_headers: dict[str, str],
    ) -> None:
        self.resource, self.owner, self._ttl_s = resource, owner, ttl_s
        self._gateway, self._proxy_headers = gateway, proxy_headers
        self._info: LeaseInfo | None = None
        self._deadline = 0.0  # time.monotonic() after which the lease counts as lost
        self._lost_reason: str | None = None
        self._gone_on_server = False  # the gateway said so: releasing would only be refused
        self._released = False

    @property
    def fence(self) -> int:
        return self._held().fence

    @property
    def expires_at(self) -> datetime:
        """The gateway's expiry (its clock); `remaining_s` is the local, conservative one."""
        return self._held().expires_at

    @property
    def remaining_s(self) -> float:
        return max(self._deadline - time.monotonic(), 0.0)

    @property
    def lost(self) -> bool:
        if (
            self._lost_reason is None
            and self._info is not None
            and time.monotonic() >= self._deadline
        ):
            self._lost_reason = "expired: no successful renewal within the TTL"
        return self._lost_reason is not None

    @property
    def lost_reason(self) -> str | None:
        return self._lost_reason if self.lost else None

    def check(self) -> None:
        """Raise LeaseLost unless this lease may still act; call it before every side effect."""
        if self.lost:
            raise LeaseLost(None, "lease_lost", f"{self.resource}: {self._lost_reason}")

    def _held(self) -> LeaseInfo:
        if self._info is None:
            raise RuntimeError(f"lease on {self.resource} was not acquired")
        return self._info

    # -- what the renewal and the calls learn ------------------------------------------------

    def _acquired(self, info: LeaseInfo, first_sent: float | None) -> None:
        sent = time.monotonic() if first_sent is None else first_sent
        self._info, self._deadline, self._lost_reason = info, sent + info.ttl_s, None
        self._released = self._gone_on_server = False  # a new lease: released on exit again

    def _renewed(self, info: LeaseInfo, sent: float) -> None:
        self.check()  # an answer arriving after the deadline does not revive the lease
        self._info, self._deadline = info, sent + info.ttl_s

    def _renewal_refused(self, exc: GatewayError) -> LeaseLost:
        """A 4xx answer to a renewal: the lease is gone on the gateway."""
        self._lost_reason, self._gone_on_server = f"renewal refused: {exc.code}", True
        return LeaseLost(exc.status, exc.code, exc.detail, exc.problem)

    def _next_renewal(self, failed: bool) -> float:
        """Seconds until the next renewal; after a transient failure, sooner as the deadline
        nears (a third of the TTL each time would leave two or three tries). Never later
        than halfway to the local deadline: an acquire or renewal answered late leaves less
        than the TTL before it."""
        delay = renew_delay(self._held().ttl_s)
        if failed:
            return max(min(delay, self.remaining_s / 3), 0.05)
        return min(delay, self.remaining_s / 2)

    def _should_release(self) -> bool:
        """Whether a release is worth sending (once, and not when the gateway said it is gone);
        from then on the lease cannot act."""
        if self._info is None or self._released:
            return False
        self._released = True
        if self._lost_reason is None:
            self._lost_reason = "released"
        return not self._gone_on_server

    @contextlib.contextmanager
    def _fenced(self, what: str, kwargs: dict[str, Any]) -> Iterator[dict[str, str]]:
        """The headers of a fenced call or session: the caller's (taken out of `kwargs`) and
        this lease's. LeaseLost before anything is sent when the lease is lost, and when the
        gateway refuses `what` for it, which marks the lease lost."""
        self.check()
        headers = dict(kwargs.pop("headers", None) or {})
        headers.update(fenced_headers(self.resource, self.fence, self.owner))
        try:
            yield headers
        except LeaseLost as exc:
            if exc.status is not None:  # the gateway's refusal, not this lease's own check
                self._lost_reason = f"gateway refused {what}: {exc.code}"
                self._gone_on_server = True
            raise

    # -- what other HTTP clients and frameworks carry ----------------------------------------

    def auth(self) -> FencedAuth:
        """`auth=` for httpx (sync and async), httpx2 and requests: every request it is given
        gets `X-Lease-Resource`, `X-Fence-Token` and `X-Lease-Owner` (and the client key, when
        it goes to the gateway), and raises LeaseLost before anything is sent once this lease
        is lost (docs/contract.md §20): `httpx.Client(auth=lease.auth())`,
        `requests.post(url, auth=lease.auth())`. It cannot see answers: a call the gateway
        refuses as stale_fence comes back as that answer, not as LeaseLost."""
        self.check()
        return FencedAuth(
            lambda: fenced_headers(self.resource, self.fence, self.owner),
            guard=self.check,
            credentials=self._proxy_headers,
            gateway=self._gateway,
        )

    def cdp_headers(self) -> dict[str, str]:
        """The headers that bind a browser automation connection to this lease: for
        Playwright's `chromium.connect_over_cdp(f"{gateway}/{mount}", headers=...)` and
        Puppeteer's `puppeteer.connect({browserWSEndpoint, headers})`. The gateway checks
        them on the discovery call and on the WebSocket upgrade (docs/contract.md §15); the
        session is closed (4409, 4408) when the lease is taken over or ends. LeaseLost when
        this lease can no longer act."""
        self.check()
        return {**fenced_headers(self.resource, self.fence, self.owner), **self._proxy_headers}

    def mcp_headers(self) -> dict[str, str]:
        """The HTTP headers that bind an MCP client's tool calls to this lease, for clients
        that take headers once per connection (an agent framework's server entry). The
        gateway fences the tool calls its rules name and passes every other message
        (docs/contract.md §16). A connection outlives the local check: once the lease is lost
        the gateway refuses its tool calls (a JSON-RPC error, code -31050); `auth=lease.auth()`
        on the connection's HTTP client checks every request instead. LeaseLost when this
        lease can no longer act."""
        self.check()
        return {**fenced_headers(self.resource, self.fence, self.owner), **self._proxy_headers}

    def mcp_meta(self) -> dict[str, Any]:
        """The `_meta` of one MCP tool call that carries this lease:
        `await session.call_tool(name, args, meta=lease.mcp_meta())`. Asked per call, so a
        lost lease raises LeaseLost before the call is sent; the gateway removes the entry
        before the MCP server sees the call (docs/contract.md §16)."""
        self.check()
        return mcp_meta(self.resource, self.fence, self.owner)
