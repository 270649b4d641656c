"""`SyncGatewayClient` and its `SyncLease`: the synchronous twin of `GatewayClient`, for tools
that run no event loop (a LangChain sync tool, a CrewAI tool, a script). The same acquire, the
same `LeaseLost`; renewal runs on a background thread (docs/contract.md §20).

It speaks HTTP with the standard library's `http.client`, one connection per request. So it
adds no dependency (httpx or requests would be one more for every agent, for a few calls a
minute); the caller and the renewal thread share no connection, so no lock; and a connection
used once is never a reused keep-alive connection that died under a fenced call, the case
where a client resends by itself (see `GatewayClient`). The price is a TCP handshake per call.
Only `http.client`'s own errors (`OSError`, `HTTPException`) escape untranslated.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any
from urllib.parse import urlencode, urlsplit

from multidict import CIMultiDict, CIMultiDictProxy

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
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


class SyncGatewayClient:
    """Lease API calls and proxied calls to one gateway, without an event loop:

        with SyncGatewayClient(url, key=...) as gw, gw.lease(res, owner=..., ttl_s=30) as lease:
            lease.post("/tool/send", json={...})

    `key` goes out as on `GatewayClient`; `ssl_context` verifies an `https://` gateway (the
    system's CAs by default) and presents the client certificate loaded into it, if any;
    `timeout_s` bounds each socket operation of a proxied call.
    """

    def __init__(
        self,
        base_url: str,
        key: str | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._prefix = parts.path
        self._key = key
        self._ssl_context = ssl_context
        self.timeout_s = timeout_s

    def __enter__(self) -> SyncGatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing stays open between calls; kept so the client reads like `GatewayClient`."""

    def lease(
        self,
        resource: str,
        owner: str,
        ttl_s: float | None = None,
        *,
        acquire_timeout_s: float = 30.0,
        auto_renew: bool = True,
    ) -> SyncLease:
        """A lease to use as `with`; `ttl_s=None` takes the rule's default."""
        return SyncLease(self, resource, owner, ttl_s, acquire_timeout_s, auto_renew)

    def _send(
        self,
        method: str,
        target: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout_s: float | None,
    ) -> tuple[int, CIMultiDictProxy[str], bytes]:
        """One request on a connection of its own; the answer read whole."""
        conn: http.client.HTTPConnection
        if self._scheme == "https":
            context = self._ssl_context or ssl.create_default_context()
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout_s, context=context
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        try:
            conn.request(method, self._prefix + target, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, CIMultiDictProxy(CIMultiDict(resp.getheaders())), data
        finally:
            conn.close()

    def api(
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
        body = None
        if json_body is not None:
            body = json.dumps(json_body).encode()
            hdrs["Content-Type"] = "application/json"
        target = f"{API}{path}" + (f"?{urlencode(params)}" if params else "")
        status, answer_headers, data = self._send(method, target, body, hdrs, timeout_s)
        if status >= 400:
            raise error_from(status, answer_headers, data)
        return json.loads(data) if data else None

    def _call(self, call: ApiCall, timeout_s: float | None = 10.0) -> Any:
        return self.api(
            call.method,
            call.path,
            json_body=call.body,
            params=call.params,
            headers=call.headers,
            timeout_s=timeout_s,
        )

    def acquire(
        self,
        resource: str,
        owner: str,
        ttl_s: float | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> LeaseInfo:
        """One acquire attempt (no retries); LeaseHeld when someone holds it."""
        doc = self._call(acquire_call(resource, owner, ttl_s, idempotency_key))
        return LeaseInfo.from_json(doc)

    def renew(
        self,
        resource: str,
        owner: str,
        fence: int,
        ttl_s: float | None = None,
        *,
        timeout_s: float | None = 10.0,
    ) -> LeaseInfo:
        """One renewal; LeaseLost (409 lease_lost) when the lease is no longer this holder's."""
        return LeaseInfo.from_json(self._call(renew_call(resource, owner, fence, ttl_s), timeout_s))

    def release(self, resource: str, owner: str, fence: int) -> None:
        self._call(release_call(resource, owner, fence))

    def get_lease(self, resource: str) -> LeaseInfo:
        return LeaseInfo.from_json(self._call(lease_call(resource)))

    def resume(self, resource: str) -> RunView:
        """The run view of `resource` (docs/contract.md §17), as `GatewayClient.resume`."""
        return RunView.from_json(self._call(resume_call(resource)))

    def checkpoint(
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
        """Record a checkpoint under `fence`, as `GatewayClient.checkpoint`."""
        call = checkpoint_call(resource, fence, step, state, owner, signature)
        attempt = 0
        while True:
            attempt += 1
            if guard is not None:
                guard()
            try:
                return CheckpointInfo.from_json(self._call(call))
            except (GatewayError, *TRANSPORT_ERRORS) as exc:
                time.sleep(checkpoint_retry_wait(exc, attempt, attempts))

    def checkpoints(
        self, resource: str, limit: int = 100, cursor: str | None = None
    ) -> tuple[list[CheckpointInfo], str | None]:
        """One page of `resource`'s checkpoints, newest first, and the next page's cursor."""
        doc = self._call(checkpoints_call(resource, limit, cursor))
        return [CheckpointInfo.from_json(item) for item in doc["items"]], doc["next_cursor"]

    def proxy_headers(self) -> dict[str, str]:
        """`Proxy-Authorization` with this client's key, when it has one."""
        return {"Proxy-Authorization": f"Bearer {self._key}"} if self._key else {}

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        data: bytes | str | None = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        """A proxied call; gateway problem+json raises, any upstream answer is returned.
        `json` or `data` is the body; `timeout_s` (default: the client's) bounds each wait."""
        if json is not None and data is not None:
            raise TypeError("pass the body as json= or as data=, not both")
        hdrs = {**(headers or {}), **self.proxy_headers()}
        body = data.encode() if isinstance(data, str) else data
        if json is not None:
            body = _json_dumps(json)
            hdrs.setdefault("Content-Type", "application/json")
        target = path + (f"?{urlencode(params)}" if params else "")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        status, answer_headers, answer = self._send(method, target, body, hdrs, timeout)
        if status >= 400 and is_gateway_problem(answer_headers, answer):
            raise error_from(status, answer_headers, answer)
        return Response(status, answer_headers, answer)


def _json_dumps(value: Any) -> bytes:  # `request`'s parameter `json` shadows the module
    return json.dumps(value).encode()


class SyncLease(LeaseState):
    """Ownership of one resource: acquire on enter, renew on a background thread (a daemon,
    so a forgotten lease never keeps a process alive), release on exit."""

    def __init__(
        self,
        client: SyncGatewayClient,
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
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> SyncLease:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def acquire(self) -> None:
        """Acquire, retrying politely on lease_held, as `Lease.acquire`."""
        attempts = AcquireAttempts(self._acquire_timeout_s)
        while True:
            key = attempts.sending()
            try:
                info = self._client.acquire(
                    self.resource, self.owner, self._ttl_s, idempotency_key=key
                )
                break
            except LeaseHeld as exc:
                wait = attempts.held(exc)
            except (GatewayError, *TRANSPORT_ERRORS) as exc:
                wait = attempts.failed(exc)
            time.sleep(wait)
        self._acquired(info, attempts.first_sent)
        if self._auto_renew:
            self._stop.clear()
            self._renewer = threading.Thread(
                target=self._renew_loop, name=f"renew {self.resource}", daemon=True
            )
            self._renewer.start()

    def renew(self) -> None:
        """Renew once; a 4xx answer (lease_lost) or a missed local deadline marks it lost."""
        self.check()
        sent = time.monotonic()
        try:
            info = self._client.renew(
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

    def _renew_loop(self) -> None:
        """Renew at about a third of the TTL; after a transient failure, retry sooner."""
        delay = self._next_renewal(failed=False)
        while not self.lost and not self._stop.wait(delay):
            try:
                self.renew()
                delay = self._next_renewal(failed=False)
            except LeaseLost:
                return
            except (GatewayError, *TRANSPORT_ERRORS):
                delay = self._next_renewal(failed=True)

    def release(self) -> None:
        """Stop renewing and release, best effort: expiry is the real recovery path."""
        if self._renewer is not None:
            self._stop.set()
            self._renewer.join()
            self._renewer = None
        if self._should_release():
            try:
                self._client.release(self.resource, self.owner, self.fence)
            except (GatewayError, *TRANSPORT_ERRORS):
                pass

    def request(self, method: str, path: str, **kwargs: Any) -> Response:
        """A fenced call through the gateway; LeaseLost is raised before anything is sent.
        Keyword arguments as `SyncGatewayClient.request`."""
        with self._fenced("a fenced call", kwargs) as headers:
            return self._client.request(method, path, headers=headers, **kwargs)

    def checkpoint(self, step: str, state: Any) -> CheckpointInfo:
        """Record where this task has got to, as `Lease.checkpoint` (docs/contract.md §17)."""
        with self._fenced("a checkpoint", {}):
            return self._client.checkpoint(
                self.resource, self.fence, step, state, owner=self.owner, guard=self.check
            )

    def get(self, path: str, **kwargs: Any) -> Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Response:
        return self.request("POST", path, **kwargs)

    def put(self, path: str, **kwargs: Any) -> Response:
        return self.request("PUT", path, **kwargs)

    def patch(self, path: str, **kwargs: Any) -> Response:
        return self.request("PATCH", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> Response:
        return self.request("DELETE", path, **kwargs)
