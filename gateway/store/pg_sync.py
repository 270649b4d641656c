"""Synchronous replication on PostgreSQL, checked rather than assumed (docs/contract.md §19,
`GATEWAY_REPLICATION=sync`).

The settings are read inside the transaction that admits a call (`SETTINGS`, returned by the
statement that locks the resource), on every new connection and at every heartbeat. A commit
is watched: PostgreSQL reports a commit whose wait for the synchronous standby was cancelled
as a success with only a WARNING notice, so the notices of the COMMIT are listened to; and a
commit still waiting after `GATEWAY_SYNC_WAIT_S` is given up on, its wait cancelled on the
server (it then commits locally, unreplicated, and releases its locks). Either way the
transaction's effects may not survive a failover: `NotReplicated`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.core import epochs
from gateway.core.errors import StoreUnavailable

SETTINGS = (
    "current_setting('synchronous_standby_names') AS sync_names, "
    "current_setting('synchronous_commit') AS sync_commit"
)
CHECK = f"SELECT {SETTINGS}"
REPLICATION_WAIT = "replication_wait"
"""The `error` of a receipt admitted by a commit that did not wait for the standby."""


class MaybeCommitted(StoreUnavailable):
    """A transaction that may be committed though its caller is refused; `result`: what the
    transaction's work returned. An admission in it is completed `not_sent` with `reason`
    once found (the store's heartbeat looks)."""

    reason = "store_unavailable"

    def __init__(self, message: str, result: object) -> None:
        super().__init__(message)
        self.result = result


class NotReplicated(MaybeCommitted):
    """A commit that did not wait for the synchronous standby: its effects are committed on
    the primary alone."""

    reason = REPLICATION_WAIT


def problem_of(row: Any) -> str | None:
    """Why a row carrying `SETTINGS` says commits would not wait (None: they would)."""
    return epochs.replication_problem(row["sync_names"], row["sync_commit"])


async def commit(conn: Any, wait_s: float, cancel: Callable[[int], Awaitable[None]]) -> str | None:
    """COMMIT, waiting at most `wait_s` for the synchronous standby; None when it waited,
    else why not. `cancel(pid)` cancels the wait of backend `pid` from another connection."""
    warnings: list[str] = []

    def listen(_conn: Any, message: Any) -> None:
        if epochs.is_replication_warning(
            str(getattr(message, "severity", "")),
            str(getattr(message, "message", "")),
            getattr(message, "detail", None),
        ):
            warnings.append(str(message.message))

    conn.add_log_listener(listen)
    try:
        pending = asyncio.ensure_future(conn.execute("COMMIT"))
        done, _ = await asyncio.wait({pending}, timeout=wait_s)
        if not done:
            with contextlib.suppress(Exception):
                await cancel(conn.get_server_pid())
            # the cancelled wait ends the COMMIT (committed locally, not replicated)
            done, _ = await asyncio.wait({pending}, timeout=wait_s)
            if not done:  # the server is gone too: the connection with it
                pending.cancel()
                conn.terminate()
            elif pending.exception() is not None:  # the commit's fate is unknown: as lost
                conn.terminate()
            return f"the commit waited longer than {wait_s}s for the synchronous standby"
        pending.result()
        await asyncio.sleep(0)  # notices are delivered through the loop, before the result
    finally:
        with contextlib.suppress(Exception):
            conn.remove_log_listener(listen)
    if warnings:
        return f"the commit's wait for the synchronous standby was cancelled: {warnings[0]}"
    return None
