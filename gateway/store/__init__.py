"""Durable state behind one protocol; the backend is chosen by the database URL's scheme."""

from __future__ import annotations

from collections.abc import Callable

from gateway.core.epochs import Mode
from gateway.core.floors import DEFAULT_GAP
from gateway.store.base import Store, StoreUnavailable

__all__ = ["Store", "StoreUnavailable", "create_store"]


def create_store(
    url: str,
    *,
    instance: str,
    durability: str,
    before_commit: Callable[[], None] = lambda: None,
    active_calls: Callable[[], int] | None = None,
    heartbeat_interval_s: float = 1.0,
    replication: Mode = "async",
    sync_wait_s: float = 5.0,
    fence_gap: int = DEFAULT_GAP,
    connect_timeout_s: float = 5.0,
    start_timeout_s: float = 60.0,
) -> Store:
    """Backends are imported here, lazily, so a SQLite user never needs a PostgreSQL driver.
    `active_calls` is SQLite's (gateway.store.group_commit); `replication` to
    `start_timeout_s` are PostgreSQL's (docs/contract.md §19)."""
    if url.startswith("sqlite:///"):
        from gateway.store.sqlite import SqliteStore, sqlite_path

        return SqliteStore(
            sqlite_path(url),
            instance=instance,
            durability=durability,
            before_commit=before_commit,
            active_calls=active_calls,
        )
    if url.startswith(("postgresql://", "postgres://")):
        try:
            from gateway.store.postgres import PostgresStore
        except ImportError as exc:  # the driver is the `postgres` extra
            raise ValueError(
                f"PostgreSQL needs the asyncpg driver: pip install "
                f"'fence-gateway[postgres]' ({exc})"
            ) from exc

        return PostgresStore(
            url,
            instance=instance,
            durability=durability,
            before_commit=before_commit,
            heartbeat_interval_s=heartbeat_interval_s,
            replication=replication,
            sync_wait_s=sync_wait_s,
            fence_gap=fence_gap,
            connect_timeout_s=connect_timeout_s,
            start_timeout_s=start_timeout_s,
        )
    raise ValueError(f"{url!r}: use sqlite:///PATH, postgresql://… or postgres://…")
