"""Several gateway processes on one PostgreSQL database (docs/contract.md §14).

`replicas(policy, count)` starts `count` gateways as real subprocesses on a fresh database of
their own, together (so they also race to migrate it), each with `GATEWAY_INSTANCE_ID`
`replica-<i>`. The database is dropped after the processes are killed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import pytest

from tests.harness import GatewayFactory, GatewayProcess
from tests.pg import create_database, drop_database, url_of

Replicas = Callable[..., Awaitable[list[GatewayProcess]]]


@pytest.fixture
def pg_url() -> Iterator[str]:
    name = create_database()
    yield url_of(name)
    drop_database(name)


@pytest.fixture
def replicas(pg_url: str, gateway_factory: GatewayFactory) -> Replicas:
    async def start(
        policy: Mapping[str, Any],
        count: int = 2,
        *,
        sweep_interval_s: float = 0.2,
        extra_env: Mapping[str, str] | None = None,
    ) -> list[GatewayProcess]:
        return list(
            await asyncio.gather(
                *(
                    gateway_factory(
                        policy,
                        sweep_interval_s=sweep_interval_s,
                        extra_env={
                            "GATEWAY_DATABASE_URL": pg_url,
                            "GATEWAY_INSTANCE_ID": f"replica-{i}",
                            **(extra_env or {}),
                        },
                    )
                    for i in range(count)
                )
            )
        )

    return start
