"""`GatewayClient` and its `Lease`, on aiohttp: for agents that run an event loop.

Only aiohttp's own transport errors escape untranslated; every answer of the gateway is read
by `errors.error_from`, and every decision is `leasing`'s, shared with `SyncGatewayClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import aiohttp

from .errors import GatewayError, LeaseHeld, LeaseLost, error_from, is_gateway_problem
from .leasing import (
    API,
    AcquireAttempts,
    ApiCall,
    LeaseState,
    acquire_call,
    checkpoint_call,
    checkpoint_retry_wait,
    checkpoints_call,
    lease_call,
    release_call,
    renew_call,
    resume_call,
)
from .records import CheckpointInfo, LeaseInfo, Response, RunView

# What a failed send raises, besides a gateway answer: the outcome of the call is unknown.
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)

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
        elif not any(_keep_refusal in t.on_request_end for t in session._trace_configs):
            # a shared session reads a refused upgrade's problem document too
            trace = _refusal_trace()
            trace.freeze()
            session._trace_configs = [*session._trace_configs, trace]
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
                raise error_from(resp.status, resp.headers, body)
            return json.loads(body) if body else None

    async def _call(self, call: ApiCall, timeout_s: float | None = 10.0) -> Any:
        return await self.api(
            call.method,
            call.path,
            json_body=call.body,
            params=call.params,
            headers=call.headers,
            timeout_s=timeout_s,
        )

    async def acquire(
        self,
        resource: str,
        owner: str,
        ttl_s: float | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> LeaseInfo:
        """One acquire attempt (no retries); LeaseHeld when someone holds it."""
        doc = await self._call(acquire_call(resource, owner, ttl_s, idempotency_key))
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
        doc = await self._call(renew_call(resource, owner, fence, ttl_s), timeout_s)
        return LeaseInfo.from_json(doc)

    async def release(self, resource: str, owner: str, fence: int) -> None:
        await self._call(release_call(resource, owner, fence))

    async def get_lease(self, resource: str) -> LeaseInfo:
        return LeaseInfo.from_json(await self._call(lease_call(resource)))

    async def resume(self, resource: str) -> RunView:
        """The run view of `resource` (docs/contract.md §17): where its last owner had got to,
        which calls since then completed, and which need confirmation first."""
        return RunView.from_json(await self._call(resume_call(resource)))

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
        guard: Callable[[], None] | None = None,
    ) -> CheckpointInfo:
        """Record a checkpoint under `fence` (for fences issued elsewhere; a gateway lease
        has `lease.checkpoint`). An identical retry appends nothing, so a write whose answer
        was lost in transit is simply sent again, up to `attempts` times. `guard` runs
        before each attempt and raises to send no more (a lease's `check`)."""
        call = checkpoint_call(resource, fence, step, state, owner, signature)
        attempt = 0
        while True:
            attempt += 1
            if guard is not None:
                guard()
            try:
                return CheckpointInfo.from_json(await self._call(call))
            except (GatewayError, *TRANSPORT_ERRORS) as exc:
                await asyncio.sleep(checkpoint_retry_wait(exc, attempt, attempts))

    async def checkpoints(
        self, resource: str, limit: int = 100, cursor: str | None = None
    ) -> tuple[list[CheckpointInfo], str | None]:
        """One page of `resource`'s checkpoints, newest first, and the next page's cursor."""
        doc = await self._call(checkpoints_call(resource, limit, cursor))
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
            if is_gateway_problem(answer_headers or {}, body):
                raise error_from(status, answer_headers or {}, body) from exc
            raise GatewayError(status, f"http_{status}", exc.message) from exc
        finally:
            _REFUSAL.reset(token)

    async def request(self, method: str, path: str, **kwargs: Any) -> Response:
        """A proxied call; gateway problem+json raises, any upstream answer is returned.
        A redirect is returned, not followed (as `SyncGatewayClient` does): following it
        would send the call again, fence and body, to wherever `Location` points."""
        headers = dict(kwargs.pop("headers", None) or {})
        headers.update(self.proxy_headers())
        kwargs.setdefault("allow_redirects", False)
        async with self.session.request(
            method, f"{self.base_url}{path}", headers=headers, **kwargs
        ) as resp:
            body = await resp.read()
            if resp.status >= 400 and is_gateway_problem(resp.headers, body):
                raise error_from(resp.status, resp.headers, body)
            return Response(resp.status, resp.headers, body)


class Lease(LeaseState):
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
        super().__init__(
            resource, owner, ttl_s, gateway=client.base_url, proxy_headers=client.proxy_headers()
        )
        self._client, self._auto_renew = client, auto_renew
        self._acquire_timeout_s = acquire_timeout_s
        self._renewer: asyncio.Task[None] | None = None

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
        """Acquire, retrying politely on lease_held (Retry-After plus jitter) until the
        timeout; a lost answer is retried under the same Idempotency-Key (`AcquireAttempts`)."""
        attempts = AcquireAttempts(self._acquire_timeout_s)
        while True:
            key = attempts.sending()
            try:
                info = await self._client.acquire(
                    self.resource, self.owner, self._ttl_s, idempotency_key=key
                )
                break
            except LeaseHeld as exc:
                wait = attempts.held(exc)
            except (GatewayError, *TRANSPORT_ERRORS) as exc:
                wait = attempts.failed(exc)
            await asyncio.sleep(wait)
        self._acquired(info, attempts.first_sent)
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
                timeout_s=max(self.remaining_s, 0.001),
            )
        except GatewayError as exc:
            if exc.status is not None and exc.is_refusal:
                raise self._renewal_refused(exc) from exc
            raise
        self._renewed(info, sent)

    async def _renew_loop(self) -> None:
        """Renew at about a third of the TTL; after a transient failure, retry sooner."""
        delay = self._next_renewal(failed=False)
        while not self.lost:
            await asyncio.sleep(delay)
            try:
                await self.renew()
                delay = self._next_renewal(failed=False)
            except LeaseLost:
                return
            except (GatewayError, *TRANSPORT_ERRORS):
                delay = self._next_renewal(failed=True)
            except RuntimeError:
                if not self._client.session.closed:
                    raise
                # the client was closed under a held lease: nothing can renew it now
                self._lost_reason = "the client was closed"
                return

    async def release(self) -> None:
        """Stop renewing and release, best effort: expiry is the real recovery path."""
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        if self._should_release():
            with contextlib.suppress(GatewayError, *TRANSPORT_ERRORS):
                await self._client.release(self.resource, self.owner, self.fence)

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
                self.resource, self.fence, step, state, owner=self.owner, guard=self.check
            )

    async def websocket(self, path: str, **kwargs: Any) -> aiohttp.ClientWebSocketResponse[Any]:
        """A fenced session (docs/contract.md §15): a WebSocket through the gateway bound to
        this lease. LeaseLost is raised before anything is sent when the lease is lost, and
        when the gateway refuses the upgrade for it (`stale_fence`, `lease_expired`, ...).
        The gateway closes the socket itself (4409 `stale_fence`, 4408 `lease_expired`) once
        the lease is taken over or ends; use it as `async with await lease.websocket(...)`."""
        with self._fenced("a session", kwargs) as headers:
            return await self._client.websocket(path, headers=headers, **kwargs)

    async def get(self, path: str, **kwargs: Any) -> Response:
        return await self.request("GET", path, **kwargs)

    async def post(self, path: str, **kwargs: Any) -> Response:
        return await self.request("POST", path, **kwargs)

    async def put(self, path: str, **kwargs: Any) -> Response:
        return await self.request("PUT", path, **kwargs)

    async def patch(self, path: str, **kwargs: Any) -> Response:
        return await self.request("PATCH", path, **kwargs)

    async def delete(self, path: str, **kwargs: Any) -> Response:
        return await self.request("DELETE", path, **kwargs)
