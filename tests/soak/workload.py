"""The soak's clients: agents that take leases, call the tool, pause, lose and retake
ownership, and sometimes act on a token they should no longer use.

Each client is an asyncio task looping over sessions of one of two kinds:

* **gateway leases** (`lease/*`, `issuer: gateway`), through `gateway.client`: acquire
  (retrying politely while someone holds it), a few fenced calls with random pauses, renewed
  in the background or not at all (a worker frozen in a slow model call), then released or
  abandoned to expire and be taken over. Sometimes, after a freeze, the stale owner sends one
  more call with its old fence directly, as a worker that froze between the client's check
  and its send would.
* **external fences** (`ext/*`, `issuer: external`): tokens from a stand-in lock service that
  hands each taker a higher one; raw fenced calls with the token, and sometimes one with an
  older token taken earlier.

Every request sent is recorded as an `Attempt` (a retry after a lost connection is another
attempt with the same `Idempotency-Key`); every call carries its own `X-Request-Id`, which the
gateway forwards, so the tool's records tie back to the attempt that caused them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence

import aiohttp

from gateway.client import GatewayClient, GatewayError, Lease, LeaseHeld, LeaseLost
from tests.harness import GatewayProcess, call, fenced_headers, problem_summary
from tests.soak.history import Attempt

PATH = "/tool/op"  # the tool's /api/op: every call a side effect
LEASE_RESOURCES = ("lease/a", "lease/b", "lease/c")
EXTERNAL_RESOURCES = ("ext/a", "ext/b", "serial/a")  # serial/*: one call at a time
RETRIES = 3  # after a lost answer, the same call (same key) is sent again at most this often
RETRY_WAIT_S = (0.2, 1.2)  # long enough for some retries to meet the restarted gateway


class ExternalIssuer:
    """A stand-in for etcd or a database sequence: every `take` of a resource gets a token
    higher than all before it (a takeover); older tokens stay in the takers' hands."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, resource: str) -> int:
        self._last[resource] = self._last.get(resource, 0) + 1
        return self._last[resource]

    def older(self, resource: str, rng: random.Random) -> int | None:
        """A token of `resource` lower than the latest, as a stale holder would have it."""
        last = self._last.get(resource, 0)
        return rng.randint(1, last - 1) if last > 1 else None


@dataclasses.dataclass
class Workload:
    gateways: Sequence[GatewayProcess]
    session: aiohttp.ClientSession  # shared by every client; never resends by itself
    lease_ttl_s: float
    stop: asyncio.Event
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    counts: Counter[str] = dataclasses.field(default_factory=Counter)
    external: ExternalIssuer = dataclasses.field(default_factory=ExternalIssuer)
    _owners: itertools.count[int] = dataclasses.field(default_factory=itertools.count)

    async def client(self, rng: random.Random) -> None:
        """One agent, until `stop` is set."""
        while not self.stop.is_set():
            if rng.random() < 0.5:
                await self._gateway_lease(rng)
            else:
                await self._external_fence(rng)
            await self._pause(rng, 0.0, 0.1)

    # -- gateway-issued leases ----------------------------------------------------------------

    async def _gateway_lease(self, rng: random.Random) -> None:
        resource = rng.choice(LEASE_RESOURCES)
        owner = f"agent-{next(self._owners)}"
        gateway = GatewayClient(rng.choice(self.gateways).url, session=self.session)
        renews = rng.random() < 0.7
        lease = gateway.lease(
            resource,
            owner,
            self.lease_ttl_s,
            acquire_timeout_s=rng.uniform(0.5, 3.0),
            auto_renew=renews,
        )
        try:
            await lease.acquire()
        except LeaseHeld:
            self.counts["acquires given up (held)"] += 1
            return
        except (GatewayError, aiohttp.ClientError, TimeoutError):
            self.counts["acquires failed"] += 1
            return
        self.counts["leases acquired"] += 1
        try:
            for _ in range(rng.randint(1, 5)):
                if self.stop.is_set():
                    break
                await self._call_with_lease(lease, rng)
                if rng.random() < 0.15:  # frozen: a slow model call, renewal or not
                    await self._pause(rng, self.lease_ttl_s * 1.2, self.lease_ttl_s * 2.0)
                else:
                    await self._pause(rng, 0.0, 0.15)
            if rng.random() < 0.2:
                # A worker that froze between the client's check and its send: it sends with
                # the fence it had, whatever happened meanwhile.
                await self._pause(rng, 0.0, self.lease_ttl_s * 2.0)
                url = rng.choice(self.gateways).url
                await self._raw_call(url, resource, lease.fence, owner, rng, "stale lease calls")
        finally:
            if renews or rng.random() < 0.5:
                await lease.release()  # best effort, as the client makes it
            else:
                self.counts["leases abandoned"] += 1

    async def _call_with_lease(self, lease: Lease, rng: random.Random) -> None:
        key = uuid.uuid4().hex
        for _ in range(1 + RETRIES):
            request_id = uuid.uuid4().hex
            began = time.monotonic()
            record = _recorder(request_id, key, lease.resource, lease.fence, began)
            try:
                answer = await lease.post(
                    PATH,
                    data=f'{{"owner": "{lease.owner}", "key": "{key}"}}'.encode(),
                    headers={"Idempotency-Key": key, "X-Request-Id": request_id},
                )
            except LeaseLost as refused:
                if refused.status is None:  # the client knew: nothing was sent
                    self.counts["calls held back by the client"] += 1
                    return
                self._record(record(refused.status, code=refused.code))
                return
            except GatewayError as refused:
                self._record(record(refused.status, code=refused.code))
                return
            except (aiohttp.ClientError, TimeoutError) as lost:
                self._record(record(None), connected=not _not_connected(lost))
                if self.stop.is_set():
                    return
                await self._pause(rng, *RETRY_WAIT_S)
                continue
            self._record(
                record(
                    answer.status,
                    receipt_id=answer.receipt_id,
                    replayed=answer.headers.get("Idempotent-Replayed") == "true",
                    outcome_recorded=answer.headers.get("X-Receipt-Outcome") != "unrecorded",
                )
            )
            return

    # -- external fences ----------------------------------------------------------------------

    async def _external_fence(self, rng: random.Random) -> None:
        resource = rng.choice(EXTERNAL_RESOURCES)
        owner = f"agent-{next(self._owners)}"
        fence = self.external.take(resource)
        for _ in range(rng.randint(1, 5)):
            if self.stop.is_set():
                return
            url = rng.choice(self.gateways).url
            await self._raw_call(url, resource, fence, owner, rng, "external calls")
            await self._pause(rng, 0.0, 0.15)
        older = self.external.older(resource, rng)
        if older is not None and rng.random() < 0.3:
            url = rng.choice(self.gateways).url
            await self._raw_call(url, resource, older, owner, rng, "stale external calls")

    # -- one fenced call, raw -----------------------------------------------------------------

    async def _raw_call(
        self, url: str, resource: str, fence: int, owner: str, rng: random.Random, kind: str
    ) -> None:
        """A fenced call by hand (no client-side check), retried with its key when the answer
        is lost. Now and then the client gives up waiting almost at once and hangs up: the
        admitted call must go on and its outcome be recorded all the same (§3)."""
        self.counts[kind] += 1
        key = uuid.uuid4().hex
        for _ in range(1 + RETRIES):
            request_id = uuid.uuid4().hex
            impatient = rng.random() < 0.05
            if impatient:
                self.counts["calls hung up on by the client"] += 1
            began = time.monotonic()
            result = await call(
                self.session,
                "POST",
                f"{url}{PATH}",
                data=f'{{"owner": "{owner}", "key": "{key}"}}'.encode(),
                headers=fenced_headers(resource, fence, owner=owner, **{"Idempotency-Key": key})
                | {"X-Request-Id": request_id},
                timeout=aiohttp.ClientTimeout(total=rng.uniform(0.005, 0.05) if impatient else 10),
            )
            record = _recorder(request_id, key, resource, fence, began)
            if result.headers is None:
                self._record(record(None), connected=not _not_connected(result.error))
                if self.stop.is_set():
                    return
                await self._pause(rng, *RETRY_WAIT_S)
                continue
            self._record(
                record(
                    result.status,
                    receipt_id=result.headers.get("X-Receipt-Id"),
                    replayed=result.headers.get("Idempotent-Replayed") == "true",
                    outcome_recorded=result.headers.get("X-Receipt-Outcome") != "unrecorded",
                    code=problem_summary(result)[1],
                )
            )
            return

    # -- bookkeeping ----------------------------------------------------------------------------

    def _record(self, attempt: Attempt, *, connected: bool = True) -> None:
        self.attempts.append(attempt)
        if not connected:
            self.counts["calls not connected (gateway down)"] += 1
        elif attempt.status is None:
            self.counts["calls without an answer"] += 1
        elif attempt.acknowledged:
            self.counts["calls acknowledged"] += 1
        elif 200 <= attempt.status < 300:
            self.counts["calls answered 2xx, outcome unrecorded"] += 1
        else:
            self.counts[f"calls refused {attempt.status} {attempt.code}"] += 1

    async def _pause(self, rng: random.Random, low: float, high: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), rng.uniform(low, high))


def _not_connected(error: BaseException | None) -> bool:
    """The gateway was not there: nothing of the request was sent."""
    return isinstance(error, aiohttp.ClientConnectorError)


def _recorder(
    request_id: str, key: str, resource: str, fence: int, began: float
) -> Callable[..., Attempt]:
    """Make the attempt once its answer (or its failure) is known."""

    def record(status: int | None, **fields: object) -> Attempt:
        return Attempt(
            request_id=request_id,
            key=key,
            resource=resource,
            fence=fence,
            began=began,
            ended=time.monotonic(),
            status=status,
            **fields,  # type: ignore[arg-type]
        )

    return record
