"""The `store` fixture: every backend, so one contract suite runs against each.

PostgreSQL: each test gets a fresh database on the server at 127.0.0.1:5432 (user postgres),
dropped at teardown. When the server is unreachable the PostgreSQL cases are skipped, except
on CI (`CI=true`), where they fail. PostgreSQL takes its time from the database, so a test
that injects a clock is SQLite-only: mark it `@pytest.mark.sqlite_only`.
"""

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gateway.core.times import Clock
from gateway.store import create_store
from gateway.store.base import Store
from tests.pg import create_database, drop_database, url_of

BACKENDS = ["sqlite", "postgres"]

_pg_databases: dict[Path, str] = {}  # tmp_path → the database created for it in this test


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "sqlite_only: the test injects a clock; PostgreSQL time is the database's"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A `sqlite_only` test runs for the sqlite backend only."""
    kept, dropped = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        backend = params.params.get("store", params.params.get("backend")) if params else None
        if item.get_closest_marker("sqlite_only") and backend not in (None, "sqlite"):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pg_database(tmp_path: Path) -> str:
    """The URL of this test's database (one per tmp_path), created on first use."""
    name = _pg_databases.get(tmp_path)
    if name is None:
        name = _pg_databases[tmp_path] = create_database()
    return url_of(name)


def make_store(
    backend: str, tmp_path: Path, instance: str = "test-1", clock: Clock | None = None
) -> Store:
    if backend == "sqlite":
        if clock is None:
            return create_store(
                f"sqlite:///{tmp_path}/gw.db", instance=instance, durability="strict"
            )
        from gateway.store.sqlite import SqliteStore

        return SqliteStore(tmp_path / "gw.db", instance=instance, durability="strict", clock=clock)
    if backend == "postgres":
        if clock is not None:
            raise ValueError(
                "PostgreSQL takes its time from the database: a test with a clock is sqlite_only"
            )
        return create_store(pg_database(tmp_path), instance=instance, durability="strict")
    raise ValueError(backend)


@pytest.fixture(autouse=True)
def _drop_pg_databases() -> Iterator[None]:
    """Drop the databases this test created, after its stores are closed."""
    yield
    while _pg_databases:
        _, name = _pg_databases.popitem()
        drop_database(name)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """A backend's name, for a test that opens (and reopens) its stores itself; a
    `sqlite_only` test gets `backend=sqlite` only."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    backend = make_store(request.param, tmp_path)
    await backend.open()
    yield backend
    await backend.close()
