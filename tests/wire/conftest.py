"""The wire's tests talk to a tool on a raw socket (`tests.hostile.wire.WireTool`): it answers
each request with the bytes, or the script, given for its path, and notes which connection
each request came on."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import pytest

from gateway.wire.pool import Pool
from tests.hostile.wire import Script, WireTool

Start = Callable[[Mapping[str, bytes | Script]], Awaitable[WireTool]]


@pytest.fixture
async def scripted() -> AsyncIterator[Start]:
    """`tool = await scripted({"/path": answer, ...})`: started, closed at teardown."""
    tools: list[WireTool] = []

    async def start(answers: Mapping[str, bytes | Script]) -> WireTool:
        tool = WireTool(answers)
        await tool.start()
        tools.append(tool)
        return tool

    yield start
    for tool in tools:
        await tool.close()


def pool_to(tool: WireTool, limit: int = 4, connect_timeout_s: float = 2.0) -> Pool:
    assert tool.port is not None
    return Pool("127.0.0.1", tool.port, limit=limit, connect_timeout_s=connect_timeout_s)
