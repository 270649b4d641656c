"""The clients file (docs/contract.md §10): who may call, with which roles, on which resources.

Only the sha256 of a key is stored; a presented key is hashed and compared with every client's
hash in constant time. The server edge (`gateway.server.auth`) asks `Clients.identify`.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.config.yaml_file import ConfigFileError, YamlFile
from gateway.core import errors
from gateway.core.globs import glob_matches, valid_glob

Role = Literal["agent", "reconciler", "admin"]


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
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise errors.Unauthenticated("the credential must be 'Bearer <key>'")
        # surrogateescape: header bytes that are not UTF-8 hash, and simply match no client
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()
        found = None
        for client in self._clients:  # no early exit: the time taken says nothing
            # both are hex text: compared as they are, constant time, nothing encoded per call
            if hmac.compare_digest(digest, client.key_sha256):
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
                raise source.error(
                    ("clients", index), f"the same {value.split()[0]} as clients[{seen[value]}]"
                )
            seen[value] = index
        if client.roles == {"agent"} and not client.resources:
            raise source.error(
                ("clients", index, "resources"), "an agent needs at least one resource glob"
            )
    return Clients(parsed.clients)
