"""Finding the PostgreSQL host that accepts writes (docs/contract.md §19).

`GATEWAY_DATABASE_URL` may name several hosts, libpq style:
`postgresql://u@h1:5432,h2:5432/db`. The store connects to each host itself, in turn, each
attempt bounded by its own timeout, rather than through asyncpg's multi-host logic, which
gives up on some errors (a host answering "the database system is starting up" ends the
whole attempt), has one timeout for all hosts, and checks `target_session_attrs` only at
connect time. A host that is starting up, read-only (a standby, or a demoted primary),
refusing or hanging is skipped; whatever the URL's `target_session_attrs` says, only a host
that accepts writes is kept. The host that last accepted writes is tried first next time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg

DEFAULT_PORT = 5432
# Query parameters this module decides itself: every host is tried, and only a writable one
# is kept, whatever the URL asks.
_OURS = frozenset({"target_session_attrs", "load_balance_hosts"})

# Read in the same round trip as the check that the server accepts writes.
WRITABLE = (
    "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off' "
    "AND current_setting('default_transaction_read_only') = 'off'"
)


class NoWritableHost(Exception):
    """No host of the URL accepts writes now; the message names each host's last error."""


@dataclass(frozen=True)
class Host:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class HostList:
    """A database URL cut into one single-host URL per host, in the URL's order."""

    hosts: tuple[Host, ...]
    template: tuple[str, str, str, str]  # scheme, user info ("" or "user[:pw]@"), path, query

    def url_of(self, host: Host) -> str:
        scheme, userinfo, path, query = self.template
        return urlunsplit((scheme, f"{userinfo}{host}", path, query, ""))


def parse_hosts(url: str) -> HostList:
    """`postgresql://u@h1:5432,h2,[::1]:5433/db?…` → its hosts, and how to reach each.

    A ValueError names what is wrong with the URL."""
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts = tuple(_host(item) for item in hostlist.split(",")) if hostlist else ()
    if not hosts:
        raise ValueError(f"{_safe(url)}: name at least one host")
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k not in _OURS])
    return HostList(hosts, (parts.scheme, f"{userinfo}@" if userinfo else "", parts.path, query))


def _host(item: str) -> Host:
    text = item.strip()
    if text.startswith("["):  # [IPv6]:port
        address, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        address, _, port = text.partition(":")
    if not address:
        raise ValueError(f"{item!r}: a host is empty")
    try:
        number = int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"{item!r}: the port is not a number") from None
    if not 0 < number < 65536:
        raise ValueError(f"{item!r}: the port is out of range")
    return Host(address, number)


def _safe(url: str) -> str:
    return url.rpartition("@")[2]


class PrimaryFinder:
    """`connect()`: a connection to a host that accepts writes, for `asyncpg.create_pool`."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.hosts = parse_hosts(url)
        self._timeout_s = timeout_s
        self._first = 0  # the index of the host that last accepted writes
        self.last_errors: dict[Host, str] = {}

    async def connect(self, *_args: Any, **kwargs: Any) -> Any:
        """Try every host once, from the one that last accepted writes; raise
        NoWritableHost naming each host's error when none does."""
        hosts = self.hosts.hosts
        for step in range(len(hosts)):
            index = (self._first + step) % len(hosts)
            host = hosts[index]
            try:
                conn = await self._try(host, kwargs)
            except Exception as exc:  # any failure skips the host
                self.last_errors[host] = one_line(exc)
                continue
            self._first = index
            self.last_errors.pop(host, None)
            return conn
        raise NoWritableHost(self.describe())

    async def _try(self, host: Host, kwargs: dict[str, Any]) -> Any:
        # The connect and the check share one bound: a host that accepts the socket and
        # then hangs is as skipped as one that never answers.
        async with asyncio.timeout(self._timeout_s):
            conn = await asyncpg.connect(self.hosts.url_of(host), **kwargs)
            try:
                if not await conn.fetchval(WRITABLE):
                    raise NoWritableHost("read-only (a standby, or in read-only mode)")
            except BaseException:
                conn.terminate()
                raise
        return conn

    def describe(self) -> str:
        """Each host and its last error, for the line that says none accepts writes."""
        return "; ".join(
            f"{host}: {self.last_errors.get(host, 'not tried')}" for host in self.hosts.hosts
        )


def one_line(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "TimeoutError: no answer within the connect timeout"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"
