"""The store's link to its PostgreSQL primary (docs/contract.md §19): a pool whose every
connection leads to a host that accepts writes, the store epoch that host is in, and, under
`GATEWAY_REPLICATION=sync`, whether synchronous replication is in place.

Every new connection of the pool goes through `PrimaryFinder` (the hosts of the URL in turn)
and then `_observe`: where the server is (system identifier, live timeline, WAL position),
recorded as a new epoch first when it is one, before the connection serves anything; and,
under `sync`, the replication settings. A replica that loses its primary gets the next one
through the same path with no restart: the pool opens fresh connections when next asked.

What `PostgresStore` asks of it: `open` (trying for up to a minute at start), `start` (the
checks made once, after the schema is migrated), `commit` (a commit that, under `sync`, must
have waited for the standby) and `note` (a replication check's result).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import asyncpg

from gateway.core.epochs import Epoch, Mode, StoreEpoch
from gateway.core.errors import StoreUnavailable
from gateway.store import pg_epochs, pg_sync
from gateway.store.base import EpochChange
from gateway.store.pg_hosts import NoWritableHost, PrimaryFinder

START_TIMEOUT_S = 60.0
"""How long a replica tries at start to find a host that accepts writes before it exits."""
_RETRY_S = 0.5
_OBSERVE = f"{pg_epochs.SEE}, {pg_sync.SETTINGS}"


class PostgresStartupError(Exception):
    """The database is one this replica must not serve on: exit 2 at start (one line)."""


class PrimaryLink:
    def __init__(
        self,
        url: str,
        *,
        instance: Callable[[], str],
        mode: Mode,
        sync_wait_s: float,
        fence_gap: int,
        connect_timeout_s: float,
        start_timeout_s: float,
        pool_size: tuple[int, int],
        command_timeout_s: float,
    ) -> None:
        self.finder = PrimaryFinder(url, connect_timeout_s)
        self.mode: Mode = mode
        self._instance = instance
        self._sync_wait_s = sync_wait_s
        self._gap = fence_gap
        self._start_timeout_s = start_timeout_s
        self._pool_size = pool_size
        self._command_timeout_s = command_timeout_s
        self._observing = False  # from `start` on: before it the schema may not exist
        self.epoch: StoreEpoch | None = None
        self._highest_lsn = 0  # the highest WAL position read in `epoch`
        self.changes: list[EpochChange] = []
        self.replication_problem: str | None = None
        # How many new epochs that applied the fence floor this replica has come into: what
        # it admitted before one must never be forwarded (its leases and receipts are gone).
        self.floors_seen = 0

    @property
    def sync(self) -> bool:
        return self.mode == "sync"

    async def open(self, reset: Callable[[Any], Any]) -> Any:
        """The pool, once a host accepts writes; StoreUnavailable naming each host's last
        error after `start_timeout_s`."""
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            try:
                return await asyncpg.create_pool(
                    connect=self.finder.connect,
                    init=self._observe,
                    min_size=self._pool_size[0],
                    max_size=self._pool_size[1],
                    reset=reset,
                    command_timeout=self._command_timeout_s,
                )
            except NoWritableHost as exc:
                if time.monotonic() >= deadline:
                    raise StoreUnavailable(
                        f"cannot connect to PostgreSQL: no host accepts writes "
                        f"(tried for {self._start_timeout_s:g}s): {exc}"
                    ) from exc
            await asyncio.sleep(_RETRY_S)

    async def start(self, conn: Any, silent_after_s: float) -> None:
        """Once at start, after the migration: the epoch (recorded when new), the mode every
        replica of the store runs in, and under `sync` a synchronous standby configured."""
        row = await conn.fetchrow(_OBSERVE)
        if self.sync:  # first: a replica that cannot serve in sync records nothing
            problem = pg_sync.problem_of(row)
            if problem is not None:
                raise PostgresStartupError(
                    f"GATEWAY_REPLICATION is sync, but on this server {problem}: configure a "
                    "synchronous standby (Patroni synchronous_mode_strict) or use async"
                )
        await self._settle_epoch(conn, pg_epochs.epoch_of(row))
        if self.epoch is not None and self.epoch.mode != self.mode:
            await self._adopt_mode(conn, self.epoch, silent_after_s)
        self._observing = True

    async def _adopt_mode(self, conn: Any, epoch: StoreEpoch, silent_after_s: float) -> None:
        async with conn.transaction():
            alive = await pg_epochs.others_alive(conn, self._instance(), silent_after_s)
            if alive:
                raise PostgresStartupError(
                    f"GATEWAY_REPLICATION is {self.mode}, but the store's current epoch is "
                    f"served in {epoch.mode} by {alive} live instance(s): every replica of a "
                    "store runs in one mode"
                )
            await pg_epochs.set_mode(conn, epoch.id, self.mode)
        self.epoch = StoreEpoch(
            epoch.id, epoch.system_id, epoch.timeline, self.mode, epoch.floor, epoch.recorded_at
        )

    async def _observe(self, conn: Any) -> None:
        """The pool's `init`: every new connection, before it serves anything."""
        if not self._observing:
            return
        row = await conn.fetchrow(_OBSERVE)
        await self._settle_epoch(conn, pg_epochs.epoch_of(row))
        if self.sync:
            self.note(pg_sync.problem_of(row))

    async def _settle_epoch(self, conn: Any, seen: Epoch) -> None:
        known = self.epoch
        if known is not None and seen.same_server_line(known) and seen.lsn >= self._highest_lsn:
            self._highest_lsn = seen.lsn
            return
        # What this replica read before: `record` sees the server again, under the lock.
        remembered = (known.id, self._highest_lsn) if known is not None else None
        await conn.execute("BEGIN")
        try:
            epoch, change, seen = await pg_epochs.record(
                conn, remembered, self.mode, self._gap, self._instance()
            )
            why = await self.commit(conn)
        except BaseException:
            if not conn.is_closed():
                await conn.execute("ROLLBACK")
            raise
        # Recorded, if on this server alone (`why`): should a failover lose it, the next
        # server is judged again.
        if change is None and known is not None and epoch.id == known.id:
            self._highest_lsn = max(self._highest_lsn, seen.lsn)
        else:
            if known is not None and epoch.id != known.id and epoch.floor == "applied":
                self.floors_seen += 1
            self.epoch, self._highest_lsn = epoch, seen.lsn
        if change is not None and change.previous is not None:  # the first is no change
            self.changes.append(change)
        if why is not None:
            raise StoreUnavailable(f"the new store epoch is not replicated yet: {why}")

    def saw_position(self, lsn: int) -> None:
        """A WAL position read from the server of the current epoch (the heartbeat's)."""
        self._highest_lsn = max(self._highest_lsn, lsn)

    async def commit(self, conn: Any) -> str | None:
        """COMMIT the connection's transaction; under `sync`, why it did not wait for the
        synchronous standby (None: it did), noted as the replication's problem."""
        if not self.sync:
            await conn.execute("COMMIT")
            return None
        why = await pg_sync.commit(conn, self._sync_wait_s, self._cancel)
        if why is not None:
            self.note(why)
        return why

    async def _cancel(self, pid: int) -> None:
        """Cancel backend `pid`'s wait, from a connection of its own (the pool's may all be
        waiting too)."""
        conn = await self.finder.connect()
        try:
            await conn.fetchval("SELECT pg_cancel_backend($1)", pid)
        finally:
            await conn.close()

    def note(self, problem: str | None) -> None:
        """A replication check's result: while there is a problem nothing is admitted."""
        self.replication_problem = problem

    def drain(self) -> list[EpochChange]:
        changes, self.changes = self.changes, []
        return changes
