"""The `store` fixture: every backend, so one contract suite runs against each."""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.store import create_store
from gateway.store.base import Store

BACKENDS = ["sqlite"]


def make_store(backend: str, tmp_path: Path, instance: str = "test-1") -> Store:
    if backend == "sqlite":
        return create_store(f"sqlite:///{tmp_path}/gw.db", instance=instance,
                            durability="strict")
    raise ValueError(backend)


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    backend = make_store(request.param, tmp_path)
    await backend.open()
    yield backend
    await backend.close()
