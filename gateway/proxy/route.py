"""Routing (docs/contract.md §2): the static mount table decides where a request goes;
nothing the client says about hosts does."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from aiohttp import web

from gateway.config.policy import PolicySet, Upstream
from gateway.core import errors
from gateway.proxy.headers import connection_named


# Not frozen, as gateway.store.base.Call says why: one is made for every call.
@dataclass(slots=True)
class Route:
    """Where a request goes: its upstream, the path after the mount, the target as received."""

    upstream: Upstream
    rest: str  # after the mount, with the query: what the tool is sent and receipts show
    request_target: str  # path and query as received, mount included: part of the fingerprint
    websocket: bool = False  # a WebSocket upgrade to an upstream that takes them (§15)


def route(request: web.Request, policies: PolicySet) -> Route:
    if request.method in ("TRACE", "CONNECT"):
        raise errors.MethodNotAllowed(f"{request.method} is not proxied")
    upgrade = "Upgrade" in request.headers
    if upgrade and not _is_websocket_upgrade(request):
        raise errors.UpgradeNotSupported("only WebSocket upgrades (GET) are proxied")
    raw = request.raw_path
    if not raw.startswith("/"):
        raise errors.InvalidRequest("only origin-form request targets (/path) are accepted")
    path, _, _query = raw.partition("?")
    if ("." in path or "%" in path) and any(
        unquote(segment) in (".", "..") for segment in path.split("/")
    ):  # a dot segment has a dot, as such or encoded (%2e): other paths need no scan
        raise errors.InvalidRequest("a path with a '.' or '..' segment is refused")
    found = policies.route(path)
    if found is None and upgrade:
        raise errors.UpgradeNotSupported(f"no upstream taking WebSocket upgrades at {path}")
    if found is None:
        raise errors.NoRoute(f"no upstream is mounted at {path}")
    upstream, _ = found
    if upgrade and not upstream.websocket:
        raise errors.UpgradeNotSupported(
            f"upstream {upstream.name} does not take WebSocket upgrades (websocket: false)"
        )
    return Route(upstream, raw[len(upstream.mount) :], raw, websocket=upgrade)


def _is_websocket_upgrade(request: web.Request) -> bool:
    """`GET` with `Upgrade: websocket` (one value) and `Connection: upgrade` (docs/contract.md
    §2, §15); the handshake's own headers are checked when it is answered."""
    upgrades = request.headers.getall("Upgrade", [])
    return (
        request.method == "GET"
        and len(upgrades) == 1
        and upgrades[0].strip().lower() == "websocket"
        and "upgrade" in connection_named(request.headers)
    )
