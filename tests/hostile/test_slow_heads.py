"""A hundred connections dribbling request heads while ordinary calls go on.

docs/contract.md §5: a connection that sends no complete head within
`GATEWAY_HEADER_TIMEOUT_S` is closed, however steadily it trickles bytes; meanwhile the
gateway keeps serving everyone else promptly, and nothing of the slow heads reaches the tool.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from tests.harness import GatewayProcess, RecordingUpstream, fenced_headers
from tests.hostile.conftest import TIMEOUT_S

pytestmark = pytest.mark.both_parsers

SLOW = 100
PROMPT_S = 0.5  # an ordinary call while the slow heads hang on takes less than this


async def dribble(port: int, n: int) -> float:
    """Open a connection, send a head one byte every 50 ms and never finish it; the seconds
    until the gateway closed it."""
    started = time.monotonic()  # before the connection: the gateway's clock starts after
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /tool/slow/{n} HTTP/1.1\r\nHost: x\r\nX-Lease-Resource: ok/slow\r\n"
        "X-Fence-Token: 1\r\nX-Padding: " + "p" * 400
    ).encode()

    async def feed() -> None:
        for byte in head:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)

    feeder = asyncio.create_task(feed())
    try:
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(reader.read(), TIMEOUT_S + 5) == b""
        return time.monotonic() - started
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        writer.close()


async def test_slow_heads_are_closed_and_hold_up_nobody(
    edge_gateway: GatewayProcess, recording_upstream: RecordingUpstream
) -> None:
    assert edge_gateway.port is not None
    before = len(recording_upstream.requests)
    slow = [asyncio.create_task(dribble(edge_gateway.port, n)) for n in range(SLOW)]
    await asyncio.sleep(0.2)  # every slow connection is open and trickling

    # Ordinary calls, fenced and plain, while the slow heads hang on.
    timings = []
    async with aiohttp.ClientSession() as session:
        for n in range(10):
            started = time.monotonic()
            async with session.post(
                f"{edge_gateway.url}/tool/prompt/{n}",
                data=b"{}",
                headers=fenced_headers("ok/prompt", 1),
            ) as fenced:
                assert fenced.status == 200
            async with session.get(f"{edge_gateway.url}/tool/prompt") as plain:
                assert plain.status == 200
            timings.append(time.monotonic() - started)
    assert max(timings) < PROMPT_S, timings

    closed_after = await asyncio.gather(*slow)
    # Closed at the head timeout, counted from the first byte, whatever trickled in since.
    assert all(TIMEOUT_S - 0.1 <= s <= TIMEOUT_S + 1.5 for s in closed_after), sorted(closed_after)
    paths = [r.path for r in recording_upstream.requests[before:]]
    assert not [p for p in paths if p.startswith("/api/slow")]
    assert len(paths) == 20
    assert edge_gateway.returncode is None
