"""The library an agent imports to hold a lease and make fenced calls through fence-gateway.

    async with GatewayClient("http://127.0.0.1:8080", key=os.environ["GATEWAY_KEY"]) as gw:
        async with gw.lease("browser/account-42", owner="run-8f21", ttl_s=30) as lease:
            page = await lease.post("/browser/sessions/7/click", json={"x": 10, "y": 20})
            print(page.status, page.json(), page.receipt_id)
            await slow_model_call()            # renewal keeps running in the background
            lease.check()                       # before a side effect that is not an HTTP call
            await lease.post("/browser/sessions/7/type", json={"text": "hi"})
            await lease.checkpoint("typed", {"session": 7})  # where a successor resumes
            async with await lease.websocket("/cdp/devtools/browser") as ws:  # a fenced session
                await ws.send_str('{"id": 1, "method": "Browser.getVersion"}')
            # Playwright over CDP: connect_over_cdp(url, headers=lease.cdp_headers())
            # MCP: headers=lease.mcp_headers() on the client's HTTP connection, or
            # call_tool(..., meta=lease.mcp_meta()) on each tool call
        view = await gw.resume("browser/account-42")   # a successor: checkpoint, calls since
    # LeaseHeld: the acquire gave up after acquire_timeout_s of polite retries.
    # LeaseLost: renewal failed or the local deadline passed; raised before any byte is sent.
    # GatewayError: any other problem+json the gateway answered (code = docs/contract.md §5 code).

Errors (only aiohttp's own transport errors escape untranslated):

    GatewayError(status, code, detail, problem)   status is None when raised locally
    ├── LeaseHeld    409 lease_held: someone else holds the resource (holder, retry_after)
    └── LeaseLost    the lease is gone: renewal refused, local deadline passed, or a fenced
                     call was refused as stale_fence / lease_expired / owner_mismatch / ...

Deadlines are kept on the local monotonic clock, conservatively: a lease's local deadline is
the moment its acquire (or last successful renewal) was *sent* plus its TTL, which is never
later than the gateway's own expiry. The gateway's fence check stays the real guard; the local
check only spares it calls that are certain to be refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp
from multidict import CIMultiDictProxy

from gateway.core.mcp import LEASE_META_KEY

API = "/_gateway/v1"
RENEW_FRACTION = 1 / 3  # renew at about a third of the TTL: two more chances before expiry
RENEW_JITTER = 0.15  # ± this fraction, so thousands of workers do not renew together
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


class LeaseHeld(GatewayError):
    """The resource is leased by someone else; `holder` and `retry_after` say who and how long."""

    @property
    def holder(self) -> str | None:
        return self.problem.get("holder")


class LeaseLost(GatewayError):
    """This lease can no longer act; every later fenced call raises it before sending."""


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


def fenced_headers(resource: str, fence: int, owner: str | None = None) -> dict[str, str]:
    """The headers of a fenced call, for fences issued elsewhere (etcd, Consul, a sequence)."""
    if isinstance(fence, bool) or not isinstance(fence, int) or not 1 <= fence < 2**63:
        raise ValueError(f"fence must be an integer from 1 to 2**63-1, got {fence!r}")
    headers = {"X-Lease-Resource": resource, "X-Fence-Token": str(fence)}
    if owner is not None:
        headers["X-Lease-Owner"] = owner
    return headers


def mcp_meta(resource: str, fence: int, owner: str | None = None) -> dict[str, Any]:
    """The `_meta` entry that carries a lease in an MCP tool call (docs/contract.md §16), for
    fences issued elsewhere: `call_tool(name, args, meta=mcp_meta(...))`. The gateway checks
    it as it checks the headers, and removes it before the MCP server sees the call."""
    fenced_headers(resource, fence, owner)  # the same checks of the fence
    entry: dict[str, Any] = {"resource": resource, "fence": fence}
    if owner is not None:
        entry["owner"] = owner
    return {LEASE_META_KEY: entry}


def renew_delay(ttl_s: float, rng: random.Random | None = None) -> float:
    """Seconds until the next renewal: a third of the TTL, ± RENEW_JITTER of it."""
    jitter = (rng or random).uniform(-RENEW_JITTER, RENEW_JITTER)
    return ttl_s * RENEW_FRACTION * (1 + jitter)


def _retry_after(headers: Any) -> float | None:
    try:
        return max(float(headers["Retry-After"]), 0.0)
    except (KeyError, ValueError):  # absent, or an HTTP-date: the gateway itself sends seconds
        return None


def _error_from(status: int, headers: Any, body: bytes) -> GatewayError:
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


# A refused WebSocket upgrade: aiohttp's ws_connect keeps the status and headers but drops the
# body, where the gateway's problem document (and its code) is. The client's own session reads
# it on the way (a trace hook), in the task that upgrades.
_REFUSAL: contextvars.ContextVar[list[tuple[int, Any, bytes]] | None] = contextvars.ContextVar(
    "fence_gateway_client_refusal", default=None
)
_REFUSAL_MAX_BYTES = 65536


async def _keep_refusal(_session: Any, _ctx: Any, params: aiohttp.TraceRequestEndParams) -> None:
    kept, response = _REFUSAL.get(), params.response
    if kept is None or response.status == 101:
        return
    with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
        body = await response.content.read(_REFUSAL_MAX_BYTES)
        kept.append((response.status, response.headers, body))


def _refusal_trace() -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(_keep_refusal)
    return trace


def _is_gateway_problem(headers: Any, body: bytes) -> bool:
    """A proxied answer the gateway wrote itself, not an upstream's own error."""
    if not headers.get("Content-Type", "").startswith("application/problem+json"):
        return False
    with contextlib.suppress(ValueError, AttributeError):
        return str(json.loads(body).get("type", "")).startswith("urn:fence-gateway:")
    return False


class GatewayClient:
    """One aiohttp session to one gateway: lease API calls and proxied calls.

    Pass `session` to share your own (it is then not closed here). `key` goes out as
    `Authorization: Bearer` on /_gateway/v1 calls and `Proxy-Authorization: Bearer` on
    proxied ones, as docs/contract.md §10 asks.

    A session made here never resends a request by itself. A session you pass should be set
    the same way, `session._retry_connection = False`: otherwise aiohttp silently sends a PUT
    or DELETE a second time when the keep-alive connection it reused turns out dead, and the
    second copy of a fenced call is a new attempt the gateway may forward again.
    """

    def __init__(
        self, base_url: str, key: str | None = None, session: aiohttp.ClientSession | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._key = key
        self._own_session = session is None
        if session is None:
            session = aiohttp.ClientSession(trace_configs=[_refusal_trace()])
            # aiohttp silently resends PUT, DELETE and other "idempotent" methods once when a
            # reused keep-alive connection turns out dead. A fenced call must be sent at most
            # once (the caller decides whether to retry, with the same Idempotency-Key), so
            # that retry is switched off (there is no public switch).
            session._retry_connection = False
        self.session = session

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session:
            await self.session.close()

    def lease(
        self,
        resource: str,
        owner: str,
        ttl_s: float | None = None,
        *,
        acquire_timeout_s: float = 30.0,
        auto_renew: bool = True,
    ) -> Lease:
        """A lease to use as `async with`; `ttl_s=None` takes the rule's default."""
        return Lease(self, resource, owner, ttl_s, acquire_timeout_s, auto_renew)

    async def api(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = 10.0,
    ) -> Any:
        """Call /_gateway/v1{path}; the decoded JSON answer (None for 204), or GatewayError."""
        hdrs = dict(headers or {})
        if self._key:
            hdrs["Authorization"] = f"Bearer {self._key}"
        async with self.session.request(
            method,
            f"{self.base_url}{API}{path}",
            json=json_body,
            params=params,
            headers=hdrs,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            body = await resp.read()
            if resp.status >= 400:
                raise _error_from(resp.status, resp.headers, body)
            return json.loads(body) if body else None

    async def acquire(
        self,
        resource: str,
        owner: str,
        ttl_s: float | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> LeaseInfo:
        """One acquire attempt (no retries); LeaseHeld when someone holds it."""
        body: dict[str, Any] = {"owner": owner}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        hdrs = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        doc = await self.api("POST", _lease_path(resource), json_body=body, headers=hdrs)
        return LeaseInfo.from_json(doc)

    async def renew(
        self,
        resource: str,
        owner: str,
        fence: int,
        ttl_s: float | None = None,
        *,
        timeout_s: float | None = 10.0,
    ) -> LeaseInfo:
        """One renewal; LeaseLost (409 lease_lost) when the lease is no longer this holder's."""
        body: dict[str, Any] = {"owner": owner, "fence": fence}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        doc = await self.api("PUT", _lease_path(resource), json_body=body, timeout_s=timeout_s)
        return LeaseInfo.from_json(doc)

    async def release(self, resource: str, owner: str, fence: int) -> None:
        await self.api(
            "DELETE", _lease_path(resource), params={"owner": owner, "fence": str(fence)}
        )

    async def get_lease(self, resource: str) -> LeaseInfo:
        return LeaseInfo.from_json(await self.api("GET", _lease_path(resource)))

    async def resume(self, resource: str) -> RunView:
        """The run view of `resource` (docs/contract.md §17): where its last owner had got to,
        which calls since then completed, and which need confirmation first."""
        return RunView.from_json(await self.api("GET", "/resources/" + _quoted(resource)))

    async def checkpoint(
        self,
        resource: str,
        fence: int,
        step: str,
        state: Any,
        *,
        owner: str | None = None,
        signature: str | None = None,
        attempts: int = 3,
    ) -> CheckpointInfo:
        """Record a checkpoint under `fence` (for fences issued elsewhere; a gateway lease
        has `lease.checkpoint`). An identical retry appends nothing, so a write whose answer
        was lost in transit is simply sent again, up to `attempts` times."""
        headers = {"X-Fence-Token": str(fence)}
        if owner is not None:
            headers["X-Lease-Owner"] = owner
        if signature is not None:
            headers["X-Fence-Signature"] = signature
        path = "/checkpoints/" + _quoted(resource)
        for attempt in range(1, attempts + 1):
            try:
                doc = await self.api(
                    "PUT", path, json_body={"step": step, "state": state}, headers=headers
                )
                return CheckpointInfo.from_json(doc)
            except (GatewayError, aiohttp.ClientError, TimeoutError) as exc:
                refused = isinstance(exc, GatewayError) and (exc.status or 0) < 500
                if refused or attempt == attempts:
                    raise
                await asyncio.sleep(0.1 * 2**attempt * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")

    async def checkpoints(
        self, resource: str, limit: int = 100, cursor: str | None = None
    ) -> tuple[list[CheckpointInfo], str | None]:
        """One page of `resource`'s checkpoints, newest first, and the next page's cursor."""
        query = {"limit": str(limit), **({"cursor": cursor} if cursor else {})}
        doc = await self.api("GET", "/checkpoints/" + _quoted(resource), params=query)
        return [CheckpointInfo.from_json(item) for item in doc["items"]], doc["next_cursor"]

    def proxy_headers(self) -> dict[str, str]:
        """`Proxy-Authorization` with this client's key, when it has one."""
        return {"Proxy-Authorization": f"Bearer {self._key}"} if self._key else {}

    async def websocket(
        self, path: str, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> aiohttp.ClientWebSocketResponse[Any]:
        """Open a WebSocket through the gateway (docs/contract.md §15); a refused upgrade
        raises GatewayError (LeaseLost for the lease codes), like a refused call. Keyword
        arguments go to aiohttp's `ws_connect` (e.g. `max_msg_size`, `heartbeat`)."""
        sent = {**(headers or {}), **self.proxy_headers()}
        kept: list[tuple[int, Any, bytes]] = []
        token = _REFUSAL.set(kept)
        try:
            ws: aiohttp.ClientWebSocketResponse[Any] = await self.session.ws_connect(
                f"{self.base_url}{path}", headers=sent, **kwargs
            )
            return ws
        except aiohttp.WSServerHandshakeError as exc:
            status, answer_headers, body = kept[0] if kept else (exc.status, exc.headers, b"")
            if _is_gateway_problem(answer_headers or {}, body):
                raise _error_from(status, answer_headers, body) from exc
            raise GatewayError(status, f"http_{status}", exc.message) from exc
        finally:
            _REFUSAL.reset(token)

    async def request(self, method: str, path: str, **kwargs: Any) -> Response:
        """A proxied call; gateway problem+json raises, any upstream answer is returned."""
        headers = dict(kwargs.pop("headers", None) or {})
        headers.update(self.proxy_headers())
        async with self.session.request(
            method, f"{self.base_url}{path}", headers=headers, **kwargs
        ) as resp:
            body = await resp.read()
            if resp.status >= 400 and _is_gateway_problem(resp.headers, body):
                raise _error_from(resp.status, resp.headers, body)
            return Response(resp.status, resp.headers, body)


def _quoted(resource: str) -> str:
    return quote(resource, safe="/:@")


def _lease_path(resource: str) -> str:
    return "/leases/" + _quoted(resource)


class Lease:
    """Ownership of one resource: acquire on enter, renew in the background, release on exit."""

    def __init__(
        self,
        client: GatewayClient,
        resource: str,
        owner: str,
        ttl_s: float | None,
        acquire_timeout_s: float,
        auto_renew: bool,
    ) -> None:
        self._client, self.resource, self.owner = client, resource, owner
        self._ttl_s, self._auto_renew = ttl_s, auto_renew
        self._acquire_timeout_s = acquire_timeout_s
        self._info: LeaseInfo | None = None
        self._deadline = 0.0  # time.monotonic() after which the lease counts as lost
        self._lost_reason: str | None = None
        self._gone_on_server = False  # the gateway said so: releasing would only be refused
        self._released = False
        self._renewer: asyncio.Task[None] | None = None

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

    async def __aenter__(self) -> Lease:
        await self.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()

    async def acquire(self) -> None:
        """Acquire, retrying politely on lease_held (Retry-After plus jitter) until the timeout.

        One Idempotency-Key per attempt, reused when the answer was lost in transit so the
        retry returns the same lease; a fresh key after a definite lease_held answer.
        """
        give_up = time.monotonic() + self._acquire_timeout_s
        key, first_sent, failures = uuid.uuid4().hex, None, 0
        while True:
            if first_sent is None:  # a retried key's lease dates from that key's first send
                first_sent = time.monotonic()
            try:
                info = await self._client.acquire(
                    self.resource, self.owner, self._ttl_s, idempotency_key=key
                )
                break
            except LeaseHeld as exc:
                failure: Exception = exc
                wait = (exc.retry_after or 1.0) * random.uniform(1.0, 1.25)
                key, first_sent = uuid.uuid4().hex, None
            except (GatewayError, aiohttp.ClientError, TimeoutError) as exc:
                if isinstance(exc, GatewayError) and (exc.status or 0) < 500:
                    raise  # a refusal (bad ttl, resource not allowed): retrying cannot help
                failure, failures = exc, failures + 1
                wait = min(0.1 * 2**failures, 2.0) * random.uniform(0.5, 1.0)
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise failure
            await asyncio.sleep(min(wait, remaining))
        self._info, self._deadline, self._lost_reason = info, first_sent + info.ttl_s, None
        if self._auto_renew:
            self._renewer = asyncio.create_task(self._renew_loop(), name=f"renew {self.resource}")

    async def renew(self) -> None:
        """Renew once; a 4xx answer (lease_lost) or a missed local deadline marks it lost."""
        self.check()
        sent = time.monotonic()
        try:
            info = await self._client.renew(
                self.resource,
                self.owner,
                self.fence,
                self._ttl_s,
                timeout_s=max(self._deadline - sent, 0.001),
            )
        except GatewayError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                self._lost_reason, self._gone_on_server = f"renewal refused: {exc.code}", True
                raise LeaseLost(exc.status, exc.code, exc.detail, exc.problem) from exc
            raise
        self.check()  # an answer arriving after the deadline does not revive the lease
        self._info, self._deadline = info, sent + info.ttl_s

    async def _renew_loop(self) -> None:
        """Renew at about a third of the TTL; after a transient failure, retry sooner."""
        delay = renew_delay(self._held().ttl_s)
        while not self.lost:
            await asyncio.sleep(delay)
            try:
                await self.renew()
                delay = renew_delay(self._held().ttl_s)
            except LeaseLost:
                return
            except (GatewayError, aiohttp.ClientError, TimeoutError):
                delay = max(min(renew_delay(self._held().ttl_s), self.remaining_s / 3), 0.05)

    async def release(self) -> None:
        """Stop renewing and release, best effort: expiry is the real recovery path."""
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        if self._info is None or self._released:
            return
        self._released = True
        if not self._gone_on_server:
            with contextlib.suppress(GatewayError, aiohttp.ClientError, TimeoutError):
                await self._client.release(self.resource, self.owner, self.fence)
        if self._lost_reason is None:
            self._lost_reason = "released"

    async def request(self, method: str, path: str, **kwargs: Any) -> Response:
        """A fenced call through the gateway; LeaseLost is raised before anything is sent."""
        with self._fenced("a fenced call", kwargs) as headers:
            return await self._client.request(method, path, headers=headers, **kwargs)

    async def checkpoint(self, step: str, state: Any) -> CheckpointInfo:
        """Record where this task has got to (docs/contract.md §17), outside the resource, so
        that a replacement worker can resume from it (`GatewayClient.resume`). Only the
        current owner can: LeaseLost before anything is sent when this lease is lost, and
        when the gateway refuses the fence (which marks it lost). Retried on a lost answer:
        the gateway appends an identical retry once."""
        with self._fenced("a checkpoint", {}):
            return await self._client.checkpoint(
                self.resource, self.fence, step, state, owner=self.owner
            )

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
            self._lost_reason = f"gateway refused {what}: {exc.code}"
            self._gone_on_server = True
            raise

    def cdp_headers(self) -> dict[str, str]:
        """The headers that bind a browser automation connection to this lease: for
        Playwright's `chromium.connect_over_cdp(f"{gateway}/{mount}", headers=...)` and
        Puppeteer's `puppeteer.connect({browserWSEndpoint, headers})`. The gateway checks
        them on the discovery call and on the WebSocket upgrade (docs/contract.md §15); the
        session is closed (4409, 4408) when the lease is taken over or ends. LeaseLost when
        this lease can no longer act."""
        self.check()
        return {
            **fenced_headers(self.resource, self.fence, self.owner),
            **self._client.proxy_headers(),
        }

    def mcp_headers(self) -> dict[str, str]:
        """The HTTP headers that bind an MCP client's tool calls to this lease, for clients
        that take headers once per connection (the SDK's `httpx` client, an agent framework's
        server entry). The gateway fences the tool calls its rules name and passes every
        other message (docs/contract.md §16). A connection outlives the local check: once the
        lease is lost the gateway refuses its tool calls (a JSON-RPC error, code -31050).
        LeaseLost when this lease can no longer act."""
        self.check()
        return {
            **fenced_headers(self.resource, self.fence, self.owner),
            **self._client.proxy_headers(),
        }

    def mcp_meta(self) -> dict[str, Any]:
        """The `_meta` of one MCP tool call that carries this lease:
        `await session.call_tool(name, args, meta=lease.mcp_meta())`. Asked per call, so a
        lost lease raises LeaseLost before the call is sent; the gateway removes the entry
        before the MCP server sees the call (docs/contract.md §16)."""
        self.check()
        return mcp_meta(self.resource, self.fence, self.owner)

    async def websocket(self, path: str, **kwargs: Any) -> aiohttp.ClientWebSocketResponse[Any]:
        """A fenced session (docs/contract.md §15): a WebSocket through the gateway bound to
        this lease. LeaseLost is raised before anything is sent when the lease is lost, and
        when the gateway refuses the upgrade for it (`stale_fence`, `lease_expired`, ...).
        The gateway closes the socket itself (4409 `stale_fence`, 4408 `lease_expired`) once
        the lease is taken over or ends; use it as `async with await lease.websocket(...)`."""
        with self._fenced("a session", kwargs) as headers:
            return await self._client.websocket(path, headers=headers, **kwargs)

    async def post(self, path: str, **kwargs: Any) -> Response:
        return await self.request("POST", path, **kwargs)

    async def put(self, path: str, **kwargs: Any) -> Response:
        return await self.request("PUT", path, **kwargs)

    async def patch(self, path: str, **kwargs: Any) -> Response:
        return await self.request("PATCH", path, **kwargs)

    async def delete(self, path: str, **kwargs: Any) -> Response:
        return await self.request("DELETE", path, **kwargs)
