"""A tool that answers badly: each case gets the outcome docs/contract.md §3 names, never a
500, and never spoils the answer of another call.

§3 "Outcome": a broken answer after the request was sent is `502 upstream_outcome_unknown`
(receipt `outcome_unknown`), no answer within `timeout_s` is `504 upstream_timeout` (receipt
`outcome_unknown`), an answer is passed on as its framing says. The tool here is a plain TCP
server writing scripted bytes: an invalid status line, no status line at all, headers that
never end, a body longer than its Content-Length (the extra bytes at once, or after a pause,
when the connection already sits idle in the gateway's pool), and a `100 Continue` followed
by nothing. Every case runs for a fenced call and a plain one, on both of aiohttp's HTTP
parsers at the gateway's front; the tool's answers are read by the gateway's own client
(`gateway.wire`, httptools' strict parser) on either.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import aiohttp
import pytest

from tests.harness import GatewayProcess, fenced_headers, make_policy
from tests.hostile.conftest import LoopThread, start_gateway
from tests.hostile.wire import Script, WireTool

pytestmark = pytest.mark.both_parsers

TIMEOUT_S = 1.0  # the tool's `timeout_s`


async def _endless_headers(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\n")
    for n in range(100_000):  # ends when the gateway gives up and closes
        writer.write(b"X-More-%d: %s\r\n" % (n, b"v" * 64))
        await writer.drain()


async def _longer_later(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
    await writer.drain()
    await asyncio.sleep(0.2)  # the gateway has the whole answer and pooled the connection
    writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 7\r\n\r\nsmuggle")


async def _continue_then_nothing(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(TIMEOUT_S * 5)


ANSWERS: dict[str, bytes | Script] = {
    "/api/invalid-status": b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\nok",
    "/api/no-status-line": b"lorem ipsum\r\n\r\n",
    "/api/endless-headers": _endless_headers,
    "/api/longer-at-once": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    b"HTTP/1.1 201 Created\r\nContent-Length: 7\r\n\r\nsmuggle",
    "/api/longer-later": _longer_later,
    "/api/continue-then-nothing": _continue_then_nothing,
    "/api/ok": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok",
}


@pytest.fixture(scope="module")
def tool(loop_thread: LoopThread) -> Iterator[WireTool]:
    server = WireTool(ANSWERS)
    loop_thread.run(server.start())
    yield server
    loop_thread.run(server.close())


@pytest.fixture(scope="module")
def gateway(
    tool: WireTool, http_parser: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    gateway = start_gateway(
        tmp_path_factory.mktemp(f"misbehaving-{http_parser}"),
        make_policy(tool.url, [{"match": "ok/**"}], timeout_s=TIMEOUT_S),
        http_parser,
    )
    yield gateway
    gateway.kill9_sync()


# path → (status, problem code or the body passed on, receipt status)
EXPECTED = {
    "/invalid-status": (502, "upstream_outcome_unknown", "outcome_unknown"),
    "/no-status-line": (502, "upstream_outcome_unknown", "outcome_unknown"),
    "/endless-headers": (502, "upstream_outcome_unknown", "outcome_unknown"),
    "/longer-at-once": (200, b"hello", "succeeded"),
    "/longer-later": (200, b"hello", "succeeded"),
    "/continue-then-nothing": (504, "upstream_timeout", "outcome_unknown"),
}


async def call(
    session: aiohttp.ClientSession, gateway: GatewayProcess, path: str, fenced: bool
) -> tuple[int, bytes, dict[str, str]]:
    headers = fenced_headers("ok/a", 1, **{"Idempotency-Key": f"{path}-{time.monotonic()}"})
    async with session.request(
        "POST" if fenced else "GET",
        f"{gateway.url}/tool{path}",
        data=b"{}" if fenced else None,
        headers=headers if fenced else {},
    ) as answer:
        return answer.status, await answer.read(), dict(answer.headers)


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "plain"])
@pytest.mark.parametrize("path", sorted(EXPECTED))
async def test_each_misbehaviour_gets_its_outcome(
    gateway: GatewayProcess, path: str, fenced: bool
) -> None:
    status, passed_on, receipt_status = EXPECTED[path]
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S * 5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.monotonic()
        got_status, body, headers = await call(session, gateway, path, fenced)
        elapsed = time.monotonic() - started
        if isinstance(passed_on, bytes):
            assert (got_status, body) == (status, passed_on)
        else:
            assert (got_status, json.loads(body)["code"]) == (status, passed_on)
        assert elapsed < TIMEOUT_S + 1.5, elapsed  # the tool's timeout bounds every case
        if fenced:
            async with session.get(
                f"{gateway.url}/_gateway/v1/receipts/{headers['X-Receipt-Id']}"
            ) as answer:
                receipt = await answer.json()
            assert receipt["status"] == receipt_status
            assert headers.get("X-Receipt-Outcome") is None  # the outcome was recorded
        # Whatever the tool left on its connection is nobody's answer: the next calls, on
        # the same pool, get their own.
        await asyncio.sleep(0.4 if path == "/longer-later" else 0.05)
        for fenced_next in (False, True):
            assert (await call(session, gateway, "/ok", fenced_next))[:2] == (200, b"ok")
    assert "Traceback" not in gateway.stderr_text()
    assert gateway.returncode is None
