"""Clients, roles and resource scopes (SPEC 10).

Without a clients file the gateway is open (`clients` is None everywhere and every check here
passes). With one, every call but health and readiness names a client by its key:

* proxied calls by `Proxy-Authorization: Bearer <key>` (the `Authorization` header belongs to
  the tool), and only `agent` or `admin` clients may make them;
* `/_gateway/` calls by `Authorization: Bearer <key>` (or `Proxy-Authorization`).

Roles: `agent` makes proxied calls and uses the lease API on the resources its globs cover;
`reconciler` reads and resolves receipts and reads leases; `admin` may do everything,
including revoking leases. Only the sha256 of a key is stored; a presented key is hashed and
compared with every client's hash in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.config.yaml_file import ConfigFileError, YamlFile
from gateway.core import errors
from gateway.core.globs import glob_matches, valid_glob
from gateway.proxy import appkeys

Role = Literal["agent", "reconciler", "admin"]
OPEN_PATHS = frozenset({"/_gateway/healthz", "/_gateway/readyz"})


class Client(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9._\-:@]{1,128}$")
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    roles: frozenset[Role] = Field(min_length=1)
    resources: tuple[str, ...] = ()

    @field_validator("resources")
    @classmethod
    def _globs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for glob in value:
            if not valid_glob(glob):
                raise ValueError(f"{glob!r} is not a resource glob")
        return value

    def may(self, *roles: Role) -> bool:
        return "admin" in self.roles or not self.roles.isdisjoint(roles)

    def covers(self, resource: str) -> bool:
        """An agent acts only on its resources; reconcilers and admins see all."""
        if "admin" in self.roles:
            return True
        return any(glob_matches(glob, resource) for glob in self.resources)


class ClientsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    clients: list[Client]


class Clients:
    def __init__(self, clients: list[Client]) -> None:
        self._clients = clients

    def identify(self, values: list[str]) -> Client:
        """The client a `Bearer <key>` header names; 401 unauthenticated otherwise."""
        if len(values) != 1:
            raise errors.Unauthenticated("send exactly one 'Bearer <key>' credential")
        scheme, _, key = values[0].partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise errors.Unauthenticated("the credential must be 'Bearer <key>'")
        # surrogateescape: header bytes that are not UTF-8 hash, and simply match no client
        digest = hashlib.sha256(key.strip().encode("utf-8", "surrogateescape")).hexdigest()
        digest_bytes = digest.encode()
        found = None
        for client in self._clients:  # no early exit: the time taken says nothing
            if hmac.compare_digest(digest_bytes, client.key_sha256.encode()):
                found = client
        if found is None:
            raise errors.Unauthenticated("the key names no client")
        return found


def load_clients(path: str | Path) -> Clients:
    """Read and validate the clients file; ConfigFileError names file, line and field."""
    file = Path(path)
    if not file.is_file():
        raise ConfigFileError(f"{file}: no such clients file")
    source = YamlFile(file)
    parsed = source.validate(ClientsFile)
    seen: dict[str, int] = {}
    for index, client in enumerate(parsed.clients):
        for value in (f"name {client.name}", f"key {client.key_sha256}"):
            if value in seen:
                raise source.error(("clients", index), f"the same {value.split()[0]} as "
                                   f"clients[{seen[value]}]")
            seen[value] = index
        if client.roles == {"agent"} and not client.resources:
            raise source.error(("clients", index, "resources"),
                               "an agent needs at least one resource glob")
    return Clients(parsed.clients)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Name the client of every call and check its role for the path (SPEC 3 step 1)."""
    clients = request.app[appkeys.CLIENTS]
    path = request.path
    if clients is None or path in OPEN_PATHS:
        return await handler(request)
    if path.startswith("/_gateway/"):
        client = clients.identify(request.headers.getall("Authorization", [])
                                  or request.headers.getall("Proxy-Authorization", []))
        _authorize_api(request, client)
    else:
        client = clients.identify(request.headers.getall("Proxy-Authorization", []))
        if not client.may("agent"):
            raise errors.Forbidden(f"client {client.name} may not make proxied calls")
    request[appkeys.CLIENT] = client
    return await handler(request)


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
            raise errors.Forbidden(f"client {client.name} may not use the lease of "
                                   f"{resource!r}")
    elif path == "/_gateway/v1/leases" and not client.may("reconciler"):
        raise errors.Forbidden(f"client {client.name} may not list leases")
