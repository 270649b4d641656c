"""Authentication and roles at the server edge (docs/contract.md §10, and §3 step 1).

Without a clients file the gateway is open (`clients` is None everywhere and every check here
passes). With one, every call but health and readiness names a client by its key:

* proxied calls by `Proxy-Authorization: Bearer <key>` (the `Authorization` header belongs to
  the tool), and only `agent` or `admin` clients may make them;
* `/_gateway/` calls by `Authorization: Bearer <key>` (or `Proxy-Authorization`).

Roles: `agent` makes proxied calls and uses the lease API on the resources its globs cover;
`reconciler` reads and resolves receipts and reads leases; `admin` may do everything,
including revoking leases and raising fences (docs/contract.md §18). The clients themselves
are `gateway.config.clients`'.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.config.clients import Client
from gateway.console.paths import PREFIX as CONSOLE
from gateway.core import errors
from gateway.proxy import appkeys, checks, mcp

OPEN_PATHS = frozenset({"/_gateway/healthz", "/_gateway/readyz"})


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
def authenticate(request: web.Request, handler: Handler) -> Awaitable[web.StreamResponse]:
    """Name the client of every call and check its role for the path (docs/contract.md §3,
    step 1). The checks need no waiting: the handler's awaitable is given back, not awaited
    here, which keeps a coroutine out of every call's stack (each wait of a call resumes the
    whole stack)."""
    clients = request.app[appkeys.CLIENTS]
    path = request.path
    if clients is None or path in OPEN_PATHS or _is_console(path):
        return handler(request)
    if path.startswith("/_gateway/"):
        client = clients.identify(
            request.headers.getall("Authorization", [])
            or request.headers.getall("Proxy-Authorization", [])
        )
        _authorize_api(request, client)
        request[appkeys.CLIENT] = client
    elif not mcp.answers_in_jsonrpc(request):
        checks.identify_caller(request)
    # else: an MCP message's body is read and checked first, then its caller
    # (docs/contract.md §16, "Order of checks"): `gateway.proxy.mcp.handle` asks
    return handler(request)


def _is_console(path: str) -> bool:
    """The console signs its people in with its own session cookie (gateway.console)."""
    return path == CONSOLE or path.startswith(f"{CONSOLE}/")


def _authorize_api(request: web.Request, client: Client) -> None:
    path, method = request.path, request.method
    if path.startswith(("/_gateway/v1/receipts", "/_gateway/v1/reconciliation")):
        if not client.may("reconciler"):
            raise errors.Forbidden(f"client {client.name} may not use the receipt API")
    elif path.startswith("/_gateway/v1/leases/"):
        resource = request.match_info.get("resource", "")
        if method == "DELETE" and request.query.get("force") == "true":
            if "admin" not in client.roles:
                raise errors.Forbidden("revoking a lease takes the admin role")
        elif method in ("GET", "HEAD") and client.may("reconciler"):
            return
        elif not (client.may("agent") and client.covers(resource)):
            raise errors.Forbidden(f"client {client.name} may not use the lease of {resource!r}")
    elif path.startswith("/_gateway/v1/checkpoints/") and method not in ("GET", "HEAD"):
        # writing one is acting on the resource (docs/contract.md §17, §3 step 1); which
        # resources, and reading, are `gateway.api.checkpoints`' to check, in §3's order
        if not client.may("agent"):
            raise errors.Forbidden(f"client {client.name} may not write checkpoints")
    elif path.startswith("/_gateway/v1/fences/") and "admin" not in client.roles:
        raise errors.Forbidden("raising fences takes the admin role")
    elif path == "/_gateway/v1/leases" and not client.may("reconciler"):
        raise errors.Forbidden(f"client {client.name} may not list leases")
