"""PostgreSQL for tests: the server at 127.0.0.1:5432 (user postgres, trust auth), one fresh
database per test, dropped afterwards.

Unreachable, a PostgreSQL test skips with one line, except on CI (`CI=true`), where it fails.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

PG_SERVER = "postgresql://postgres@127.0.0.1:5432"
PG_UNREACHABLE = "PostgreSQL is not reachable at 127.0.0.1:5432"


def run_sync(coro_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run a coroutine on a loop of its own, also from inside a running test's loop."""

    async def main() -> T:
        return await coro_fn(*args)

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, main()).result()


async def server_sql(statement: str, database: str = "postgres") -> list[Any]:
    """One statement on the server, as the superuser; its rows."""
    import asyncpg

    conn = await asyncpg.connect(f"{PG_SERVER}/{database}", timeout=5)
    try:
        return list(await conn.fetch(statement))
    finally:
        await conn.close()


def create_database() -> str:
    """A fresh database's name (skips, or fails on CI, when the server does not answer)."""
    name = f"fg_test_{secrets.token_hex(6)}"
    try:
        run_sync(server_sql, f"CREATE DATABASE {name}")
    except (OSError, TimeoutError) as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{PG_UNREACHABLE}: {exc}")
        pytest.skip(PG_UNREACHABLE)
    return name


def drop_database(name: str) -> None:
    run_sync(server_sql, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def url_of(name: str) -> str:
    return f"{PG_SERVER}/{name}"
