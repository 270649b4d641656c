"""The last check before a call's bytes leave (docs/contract.md §14, "A replica fences
itself"): asked once a connection to the tool is in hand, new or reused, and when it says no,
nothing reaches the tool, the call is `not_sent`, and the connection is closed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from multidict import CIMultiDict

from gateway.config.policy import Upstream
from gateway.proxy.upstream import UpstreamFailure, Upstreams
from tests.harness import RecordingUpstream


@pytest.mark.parametrize("connection", ["new", "reused"])
async def test_a_withdrawn_call_never_reaches_the_tool(
    upstream: RecordingUpstream, connection: str
) -> None:
    tool = Upstream(name="tool", url=upstream.url, mount="/tool")
    upstreams = Upstreams({"tool": tool})
    await upstreams.open()
    try:
        deadline = asyncio.get_running_loop().time() + 5
        if connection == "reused":  # one call first leaves a keep-alive connection behind
            async with await upstreams.send(tool, "GET", "/warm", CIMultiDict(), None, deadline):
                pass
        asked = []

        def may_send() -> bool:
            asked.append(True)
            return False

        with pytest.raises(UpstreamFailure) as failure:
            await upstreams.send(
                tool, "POST", "/act", CIMultiDict(), b"{}", deadline, may_send=may_send
            )
        assert failure.value.as_outcome(0.0).status == "not_sent"
        assert failure.value.as_outcome(0.0).error == "instance_lapsed"
        assert failure.value.error.code == "store_unavailable"
        assert asked == [True]
        await asyncio.sleep(0.1)
        assert [r.path for r in upstream.requests] == (
            ["/api/warm"] if connection == "reused" else []
        )
        # the connection it was asked on (the warm one, when reused) is neither pooled nor
        # left open
        assert upstream.port is not None and open_connections_to(upstream.port) == 0
    finally:
        await upstreams.close()


def open_connections_to(port: int) -> int:
    """Established TCP connections to 127.0.0.1:`port` from this host (Linux's table)."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    remote = f"0100007F:{port:04X}"
    return sum(1 for row in rows if row.split()[2] == remote and row.split()[3] == "01")


async def test_asked_again_just_before_the_body_is_written(upstream: RecordingUpstream) -> None:
    """A call with a body is written by a task of aiohttp's own, after the connection is in
    hand; the process may lapse (a pause, a slow loop) between the two. The check is asked
    again at the start of that task: when the instance lapsed meanwhile, nothing is sent."""
    tool = Upstream(name="tool", url=upstream.url, mount="/tool")
    upstreams = Upstreams({"tool": tool})
    await upstreams.open()
    try:
        answers = iter([True, False])  # alive with the connection in hand; lapsed at the write
        deadline = asyncio.get_running_loop().time() + 5
        with pytest.raises(UpstreamFailure) as failure:
            await upstreams.send(
                tool, "POST", "/act", CIMultiDict(), b"{}", deadline, may_send=lambda: next(answers)
            )
        assert failure.value.as_outcome(0.0).status == "not_sent"
        assert failure.value.as_outcome(0.0).error == "instance_lapsed"
        await asyncio.sleep(0.1)
        assert upstream.requests == []
        assert upstream.port is not None and open_connections_to(upstream.port) == 0
        # a call whose checks both say yes goes through, on a connection of its own
        async with await upstreams.send(
            tool, "POST", "/act", CIMultiDict(), b"{}", deadline, may_send=lambda: True
        ) as answer:
            assert answer.status == 200
        assert [r.path for r in upstream.requests] == ["/api/act"]
    finally:
        await upstreams.close()


async def test_a_session_s_handshake_is_asked_too(upstream: RecordingUpstream) -> None:
    """A session's upgrade (docs/contract.md §15) goes through the same last check: a lapsed
    process writes no handshake, and the session is `not_sent`."""
    tool = Upstream(name="tool", url=upstream.url, mount="/tool", websocket=True)
    upstreams = Upstreams({"tool": tool})
    await upstreams.open()
    try:
        deadline = asyncio.get_running_loop().time() + 5
        asked = []

        def may_send() -> bool:
            asked.append(True)
            return False

        with pytest.raises(UpstreamFailure) as failure:
            await upstreams.open_websocket(
                tool, "/ws", CIMultiDict(), (), deadline, may_send=may_send
            )
        assert failure.value.as_outcome(0.0).status == "not_sent"
        assert failure.value.as_outcome(0.0).error == "instance_lapsed"
        assert asked == [True]
        await asyncio.sleep(0.1)
        assert upstream.requests == []
        assert upstream.port is not None and open_connections_to(upstream.port) == 0
    finally:
        await upstreams.close()
