"""Routing (docs/contract.md §2): the static mount table decides where a request goes;
nothing the client says about hosts does."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from aiohttp import web

from gateway.config.policy import PolicySet, Upstream
from gateway.core import errors


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: its upstream, the path after the mount, the target as received."""

    upstream: Upstream
    rest: str  # after the mount, with the query: what the tool is sent and receipts show
    request_target: str  # path and query as received, mount included: part of the fingerprint


def route(request: web.Request, policies: PolicySet) -> Route:
    if request.method in ("TRACE", "CONNECT"):
        raise errors.MethodNotAllowed(f"{request.method} is not proxied")
    if "Upgrade" in request.headers:
        raise errors.UpgradeNotSupported("protocol upgrades (WebSocket) are not proxied")
    raw = request.raw_path
    if not raw.startswith("/"):
        raise errors.InvalidRequest("only origin-form request targets (/path) are accepted")
    path, _, _query = raw.partition("?")
    if any(unquote(segment) in (".", "..") for segment in path.split("/")):
        raise errors.InvalidRequest("a path with a '.' or '..' segment is refused")
    found = policies.route(path)
    if found is None:
        raise errors.NoRoute(f"no upstream is mounted at {path}")
    upstream, _ = found
    return Route(upstream, raw[len(upstream.mount) :], raw)
