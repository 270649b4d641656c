"""Shared fixtures: a recording upstream, gateway subprocesses, and an HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.harness import GatewayFactory, GatewayProcess, RecordingUpstream, write_policy


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    """A real aiohttp server on 127.0.0.1 that records every request it receives."""
    async with RecordingUpstream() as server:
        yield server


@pytest.fixture
async def gateway_factory(tmp_path: Path) -> AsyncIterator[GatewayFactory]:
    """Start `python -m gateway serve` on a policy dict; every process is killed on teardown.

    `await gateway_factory(policy, extra_env={...}, sweep_interval_s=0.2)`
    """
    started: list[GatewayProcess] = []

    async def factory(
        policy: Mapping[str, Any],
        *,
        extra_env: Mapping[str, str] | None = None,
        sweep_interval_s: float = 0.2,
    ) -> GatewayProcess:
        workdir = tmp_path / f"gw{len(started)}"
        workdir.mkdir()
        policy_path = write_policy(workdir / "policies.yaml", policy)
        gateway = GatewayProcess(
            workdir, policy_path, sweep_interval_s=sweep_interval_s, extra_env=extra_env
        )
        started.append(gateway)
        return await gateway.start()

    yield factory
    for gateway in started:
        gateway.kill9_sync()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client with no connection limit (concurrency tests open many calls at once)."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        yield client
