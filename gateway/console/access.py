"""Who may do what in the console: the roles of docs/contract.md §10, as the console reads them.

An `agent` acts on resources through the proxy and has nothing to see here; a `reconciler`
reads receipts and leases and resolves or probes lost outcomes; an `admin` may do everything,
revoking leases too. Without a clients file the gateway runs open (on loopback, unless told
otherwise) and so does its console: no sign-in, everything allowed, as over the API.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Permissions:
    read: bool = False
    resolve: bool = False  # resolve and probe `outcome_unknown` receipts
    revoke: bool = False  # end anyone's lease


def permissions(roles: Iterable[str]) -> Permissions:
    held = frozenset(roles)
    if "admin" in held:
        return Permissions(read=True, resolve=True, revoke=True)
    if "reconciler" in held:
        return Permissions(read=True, resolve=True)
    return Permissions()


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who is looking: a signed-in client, the open gateway's local operator, or nobody yet."""

    name: str
    roles: frozenset[str]
    signed_in: bool
    open_mode: bool = False

    @property
    def may(self) -> Permissions:
        return permissions(self.roles) if self.signed_in else Permissions()

    @property
    def source(self) -> str:
        """The `source` a resolution made by this viewer is prefilled with (§7)."""
        return f"operator:{self.name}"


NOBODY = Viewer(name="", roles=frozenset(), signed_in=False)
LOCAL_OPERATOR = Viewer(name="local", roles=frozenset({"admin"}), signed_in=True, open_mode=True)


def client_viewer(name: str, roles: Iterable[str]) -> Viewer:
    return Viewer(name=name, roles=frozenset(roles), signed_in=True)
