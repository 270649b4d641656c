"""What a fenced call carries, for any HTTP client: the lease headers, the `_meta` entry of an
MCP tool call, and an `auth=` callable for httpx, httpx2 and requests (docs/contract.md §20)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from gateway.core.mcp import LEASE_META_KEY


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


class _Request(Protocol):
    """What httpx's and httpx2's `Request` and requests' `PreparedRequest` have in common."""

    @property
    def url(self) -> Any: ...

    @property
    def headers(self) -> MutableMapping[str, str]: ...


RequestT = TypeVar("RequestT", bound=_Request)


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, with the scheme's default port filled in."""
    parts = urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port or default


class FencedAuth:
    """An `auth=` for httpx (sync and async clients), httpx2 and requests, in the one shape all
    three accept: a plain callable that is given the request before it is sent and returns it.
    httpx and httpx2 call it as the request is sent, requests as it is prepared; either way
    before any byte leaves the process. `guard` (a lease's `check`) raises LeaseLost then, and
    nothing is sent.

    `credentials` (the client key, `Proxy-Authorization`) go only to requests for `gateway`'s
    origin: a key is a bearer secret and the fence headers alone are no use elsewhere. The
    callable sees the first request only: a redirect that httpx or httpx2 follows keeps every
    header of it, to whatever origin it leads, and requests keeps all but Proxy-Authorization.
    """

    __slots__ = ("_credentials", "_gateway", "_guard", "_headers")

    def __init__(
        self,
        headers: Mapping[str, str] | Callable[[], Mapping[str, str]],
        *,
        guard: Callable[[], None] | None = None,
        credentials: Mapping[str, str] | None = None,
        gateway: str | None = None,
    ) -> None:
        # a callable is asked at each request: a lease's headers carry its current fence
        self._headers = headers if callable(headers) else dict(headers)
        self._guard = guard
        self._credentials = dict(credentials or {})
        self._gateway = origin(gateway) if gateway else None

    def __call__(self, request: RequestT) -> RequestT:
        if self._guard is not None:
            self._guard()
        request.headers.update(self._headers() if callable(self._headers) else self._headers)
        if self._credentials and origin(str(request.url)) == self._gateway:
            request.headers.update(self._credentials)
        return request

    def __repr__(self) -> str:  # never the key
        shown = "a lease's current headers" if callable(self._headers) else self._headers
        return f"FencedAuth({shown!r})"


def fenced_auth(resource: str, fence: int, owner: str | None = None) -> FencedAuth:
    """`auth=` for httpx, httpx2 or requests that fences every request with a fence issued
    elsewhere (an etcd revision, a Consul LockIndex, a sequence): `requests.post(url,
    auth=fenced_auth("deploy/prod", 184, "run-8f21"))`. A gateway lease has `lease.auth()`,
    which also refuses to send once the lease is lost."""
    return FencedAuth(fenced_headers(resource, fence, owner))
