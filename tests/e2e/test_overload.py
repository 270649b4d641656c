"""`GATEWAY_MAX_INFLIGHT` through the real gateway process (docs/contract.md §11): beyond the
limit a call is answered `503 overloaded` with `Retry-After: 1` before anything is admitted or
forwarded, and leaves no receipt; `/_gateway/` paths are not counted."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web, web_protocol
from aiohttp.http_parser import HttpRequestParserPy
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.server import overload
from tests.e2e.served import Served, fenced_post, read_answer, served
from tests.harness import (
    Behavior,
    GatewayFactory,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    make_policy,
    problem,
)


async def test_a_call_beyond_a_fixed_limit_is_shed_before_anything_happens(
    gateway_factory: GatewayFactory, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    gate = asyncio.Event()
    upstream.script("/api/slow", Behavior(gate=gate))
    gateway = await gateway_factory(
        make_policy(upstream.url, [{"match": "job/*"}]),
        extra_env={"GATEWAY_MAX_INFLIGHT": "1"},
    )
    held = asyncio.create_task(
        call(session, "POST", f"{gateway.url}/tool/slow", headers=fenced_headers("job/a", 1))
    )
    await upstream.wait_received(1)

    shed = await call(
        session,
        "POST",
        f"{gateway.url}/tool/act",
        headers=fenced_headers("job/b", 7, **{"X-Request-Id": "shed-1"}),
        data=b'{"n": 1}',
    )
    assert shed.status == 503
    body = problem(shed)
    assert body["code"] == "overloaded"
    assert body["type"] == "urn:fence-gateway:overloaded"
    assert body["request_id"] == "shed-1"
    assert shed.headers is not None and shed.headers["Retry-After"] == "1"
    plain = await call(session, "GET", f"{gateway.url}/tool/read")
    assert plain.status == 503 and problem(plain)["code"] == "overloaded"

    # /_gateway/ is not counted: the operator can still look while the process is full
    health = await call(session, "GET", f"{gateway.url}/_gateway/v1/receipts?resource=job/b")
    assert health.status == 200

    gate.set()
    assert (await held).status == 200
    assert [r.path for r in upstream.received()] == ["/api/slow"]  # the shed calls never left
    assert await fetch_receipts(session, gateway.url, resource="job/b") == []

    after = await call(
        session, "POST", f"{gateway.url}/tool/act", headers=fenced_headers("job/b", 7)
    )
    assert after.status == 200  # the slot is free again
    text = (await call(session, "GET", f"{gateway.url}/_gateway/metrics")).body.decode()
    assert 'fence_gateway_rejections_total{code="overloaded",upstream="-"} 2.0' in text


async def test_the_adaptive_limit_lets_an_ordinary_load_through(
    gateway_factory: GatewayFactory, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    """`auto` is the default; 64 calls at once are well within what it starts from."""
    gateway = await gateway_factory(make_policy(upstream.url, [{"match": "job/*"}]))
    results = await asyncio.gather(
        *(
            call(
                session,
                "POST",
                f"{gateway.url}/tool/act",
                headers=fenced_headers(f"job/{i % 8}", 1),
                data=b'{"n": %d}' % i,
            )
            for i in range(64)
        )
    )
    assert [r.status for r in results] == [200] * 64


async def test_an_mcp_client_is_shed_in_json_rpc(
    gateway_factory: GatewayFactory, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    """An MCP client reads JSON-RPC, not problem+json (docs/contract.md §16): a shed POST is a
    JSON-RPC error too, with id null since its body was never read."""
    gate = asyncio.Event()
    upstream.script("/api/mcp", Behavior(gate=gate))
    gateway = await gateway_factory(
        make_policy(upstream.url, [{"match": "mail/*", "tools": ["send_*"]}], mcp=True),
        extra_env={"GATEWAY_MAX_INFLIGHT": "1"},
    )
    listing = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}'
    json_headers = {"Content-Type": "application/json"}
    held = asyncio.create_task(
        call(session, "POST", f"{gateway.url}/tool/mcp", headers=json_headers, data=listing)
    )
    await upstream.wait_received(1)
    shed = await call(
        session, "POST", f"{gateway.url}/tool/mcp", headers=json_headers, data=listing
    )
    assert shed.status == 503
    assert shed.headers is not None and shed.headers["Retry-After"] == "1"
    assert shed.headers["Content-Type"].startswith("application/json")
    answer = json.loads(shed.body)
    assert answer["id"] is None and answer["error"]["code"] == -31050
    assert answer["error"]["data"]["code"] == "overloaded"
    gate.set()
    assert (await held).status == 200
    assert [r.path for r in upstream.received()] == ["/api/mcp"]


@contextlib.asynccontextmanager
async def mcp_tool_with_a_stream(release: asyncio.Event) -> AsyncIterator[str]:
    """An MCP server whose GET stream (the 2025 revisions' server-to-client stream) stays open
    until `release` is set, and whose POSTs are answered at once; its base URL."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": open\n\n")
        await release.wait()
        await response.write_eof()
        return response

    async def post(request: web.Request) -> web.Response:
        return web.json_response({"jsonrpc": "2.0", "id": 1, "result": {"tools": []}})

    tool = web.Application()
    tool.router.add_get("/api/mcp", stream)
    tool.router.add_post("/api/mcp", post)
    runner = web.AppRunner(tool)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/api"
    finally:
        release.set()
        await runner.cleanup()


# --------------------------------------------------------------------------------------------
# Shedding in the HTTP server itself: the gateway in process, served by `GatewayRunner` as
# `fence-gateway serve` serves it, so that the requests aiohttp builds can be counted.
# --------------------------------------------------------------------------------------------


async def hold_one_call(
    session: aiohttp.ClientSession, gateway: Served, upstream: RecordingUpstream
) -> tuple[asyncio.Event, asyncio.Task[Any]]:
    """A call held at the tool, taking the one slot of GATEWAY_MAX_INFLIGHT=1."""
    gate = asyncio.Event()
    upstream.script("/api/slow", Behavior(gate=gate))
    held = asyncio.create_task(
        call(session, "POST", f"{gateway.url}/tool/slow", headers=fenced_headers("job/a", 1))
    )
    await upstream.wait_received(1)
    return gate, held


async def test_a_crowd_over_the_limit_is_answered_before_any_request_is_built(
    tmp_path: Path, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    """Each shed call is answered from its parsed head: aiohttp builds no request for it, and
    its connection, body and all, stays in step for the next call."""
    async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}]), "1") as gateway:
        gate, held = await hold_one_call(session, gateway, upstream)
        before = gateway.requests_made[0]
        crowd = [await gateway.connect() for _ in range(40)]
        for n, (_, writer) in enumerate(crowd):
            writer.write(fenced_post("/tool/act", b'{"n": %d}' % n, X_Request_Id=f"crowd-{n}"))
        for n, (reader, _) in enumerate(crowd):
            status, headers, body = await read_answer(reader)
            assert status == 503 and headers["retry-after"] == "1"
            assert headers["content-type"] == "application/problem+json; charset=utf-8"
            assert headers["x-request-id"] == f"crowd-{n}"
            document = json.loads(body)
            assert document["code"] == "overloaded" and document["request_id"] == f"crowd-{n}"
            assert document["type"] == "urn:fence-gateway:overloaded"
            assert document["status"] == 503 and document["title"] == "Overloaded"
        assert gateway.requests_made[0] == before  # not one request object for 40 answers

        gate.set()
        assert (await held).status == 200
        # the same connections, their next call (one at a time: the limit is 1), read once the
        # Retry-After second is over
        for n, (reader, writer) in enumerate(crowd[:5]):
            writer.write(fenced_post("/tool/act", b'{"after": %d}' % n))
            status, _, _ = await read_answer(reader)
            assert status == 200
        bodies = sorted(r.body for r in upstream.received() if r.path_qs == "/api/act")
        assert bodies == sorted(b'{"after": %d}' % n for n in range(5))  # nothing shed left
        for _, writer in crowd:
            writer.close()
        text = (await call(session, "GET", f"{gateway.url}/_gateway/metrics")).body.decode()
        assert 'fence_gateway_rejections_total{code="overloaded",upstream="-"} 40.0' in text
        assert gateway.app[overload.LIMIT].in_flight == 0


async def test_shed_calls_behind_another_or_before_their_body_keep_the_connection_in_step(
    tmp_path: Path, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    """A shed call that cannot be answered from its head at once (pipelined behind another, or
    its body not all in) is answered in its turn, its body read and dropped."""
    async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}]), "1") as gateway:
        gate, held = await hold_one_call(session, gateway, upstream)
        reader, writer = await gateway.connect()
        writer.write(fenced_post("/tool/one", b'{"n": 1}') + fenced_post("/tool/two", b"[2]"))
        head, body = fenced_post("/tool/three", b'{"n": 3}').split(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")
        answers = [await read_answer(reader) for _ in range(2)]
        assert [status for status, _, _ in answers] == [503, 503]
        writer.write(body[:3])
        await asyncio.sleep(0.05)
        writer.write(body[3:])
        status, headers, document = await read_answer(reader)
        assert status == 503 and json.loads(document)["code"] == "overloaded"
        assert headers["retry-after"] == "1"

        gate.set()
        assert (await held).status == 200
        writer.write(fenced_post("/tool/four", b'{"n": 4}'))
        status, _, _ = await read_answer(reader)
        assert status == 200
        assert [(r.path_qs, r.body) for r in upstream.received()][1:] == [
            ("/api/four", b'{"n": 4}')
        ]
        writer.close()
        assert gateway.app[overload.LIMIT].in_flight == 0


async def test_a_shed_call_answered_in_its_turn_leaves_its_connection_unread_too(
    tmp_path: Path, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    """Shed calls answered in their turn (pipelined) leave their connection unread for the
    Retry-After second as one answered at once does: a client that resends at once is read,
    and admitted, only after it."""
    loop = asyncio.get_running_loop()
    async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}]), "1") as gateway:
        gate, held = await hold_one_call(session, gateway, upstream)
        reader, writer = await gateway.connect()
        writer.write(fenced_post("/tool/one", b'{"n": 1}') + fenced_post("/tool/two", b"[2]"))
        answers = [await read_answer(reader) for _ in range(2)]
        shed_at = loop.time()
        assert [status for status, _, _ in answers] == [503, 503]
        gate.set()
        assert (await held).status == 200  # the one slot is free again

        writer.write(fenced_post("/tool/three", b'{"n": 3}'))
        status, _, _ = await read_answer(reader)
        assert status == 200
        assert loop.time() - shed_at >= 0.8  # Retry-After: 1, counted from the last 503
        assert [r.path_qs for r in upstream.received()][1:] == ["/api/three"]
        writer.close()
        assert gateway.app[overload.LIMIT].in_flight == 0


async def test_an_open_mcp_stream_is_counted_only_until_its_head_is_written(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """An unfenced MCP stream stays open as long as its client listens: counted for its whole
    life, streams held open by idle clients would fill GATEWAY_MAX_INFLIGHT and every call
    would be shed. It gives its place back once its head is written."""
    release = asyncio.Event()
    async with mcp_tool_with_a_stream(release) as tool_url:
        policy = make_policy(tool_url, [{"match": "mail/*", "tools": ["send_*"]}], mcp=True)
        async with served(tmp_path, policy, "1") as gateway:
            limit = gateway.app[overload.LIMIT]
            async with session.get(f"{gateway.url}/tool/mcp") as streaming:
                assert streaming.status == 200
                assert await streaming.content.readline() == b": open\n"
                assert limit.in_flight == 0  # the stream is open, and holds no place
                listing = await call(
                    session,
                    "POST",
                    f"{gateway.url}/tool/mcp",
                    headers={"Content-Type": "application/json"},
                    data=b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}',
                )
                assert listing.status == 200  # not shed
                release.set()
                assert await streaming.read() == b"\n"  # the rest of the event, then the end
            assert limit.in_flight == 0


@pytest.mark.parametrize("parser", ["c", "python"])
async def test_a_connection_shed_again_and_again_is_still_parsed(
    tmp_path: Path,
    upstream: RecordingUpstream,
    session: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    parser: str,
) -> None:
    """aiohttp's parser stops handing over requests while 32 it handed over are not yet taken:
    each call answered from its head must count as taken, or a client that keeps its
    connection through half a minute of overload has its next calls never read."""
    if parser == "python":
        monkeypatch.setattr(web_protocol, "HttpRequestParser", HttpRequestParserPy)
    monkeypatch.setattr(overload, "RETRY_AFTER_S", 0.01)  # the pause, not the header
    async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}]), "1") as gateway:
        gate, held = await hold_one_call(session, gateway, upstream)
        made = gateway.requests_made[0]
        reader, writer = await gateway.connect()
        for n in range(40):
            writer.write(fenced_post("/tool/act", b'{"n": %d}' % n))
            assert (await read_answer(reader))[0] == 503
            await asyncio.sleep(0.02)  # past the pause: the next is answered from its head too
        assert gateway.requests_made[0] == made
        gate.set()
        assert (await held).status == 200
        healthz = b"GET /_gateway/healthz HTTP/1.1\r\nHost: gateway\r\n\r\n"
        writer.write(fenced_post("/tool/after", b"{}") + healthz * 2)
        assert [(await read_answer(reader))[0] for _ in range(3)] == [200, 200, 200]
        writer.close()


async def test_a_shed_call_that_asked_to_close_is_answered_and_closed(
    tmp_path: Path, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}]), "1") as gateway:
        gate, held = await hold_one_call(session, gateway, upstream)
        made = gateway.requests_made[0]
        reader, writer = await gateway.connect()
        writer.write(fenced_post("/tool/act", b"{}", Connection="close"))
        status, headers, _ = await read_answer(reader)
        assert status == 503 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed
        assert gateway.requests_made[0] == made
        gate.set()
        await held


async def test_a_shed_head_request_is_answered_without_a_body(
    tmp_path: Path, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}]), "1") as gateway:
        gate, held = await hold_one_call(session, gateway, upstream)
        made = gateway.requests_made[0]
        reader, writer = await gateway.connect()
        writer.write(b"HEAD /tool/page HTTP/1.1\r\nHost: gateway\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nContent-Length: " in head
        assert gateway.requests_made[0] == made
        gate.set()
        assert (await held).status == 200
        writer.write(b"GET /_gateway/healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        assert (await read_answer(reader))[0] == 200  # no stray body before it
        writer.close()


async def test_upgrades_are_shed_and_the_gateway_paths_are_not(
    tmp_path: Path, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}]), "1") as gateway:
        gate, held = await hold_one_call(session, gateway, upstream)
        reader, writer = await gateway.connect()
        writer.write(
            b"GET /tool/ws HTTP/1.1\r\nHost: gateway\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\n\r\n"
        )
        status, _, body = await read_answer(reader)
        assert status == 503 and json.loads(body)["code"] == "overloaded"
        writer.close()
        # CONNECT switches the parser to a tunnel as upgrades do: shed, and in step after
        reader, writer = await gateway.connect()
        writer.write(b"CONNECT tool.example:443 HTTP/1.1\r\nHost: tool.example:443\r\n\r\n")
        status, _, body = await read_answer(reader)
        assert status == 503 and json.loads(body)["code"] == "overloaded"
        writer.write(b"GET /_gateway/healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        assert (await read_answer(reader))[0] == 200
        writer.close()
        for path in ("/_gateway/healthz", "/_gateway/v1/receipts?resource=job/a"):
            assert (await call(session, "GET", gateway.url + path)).status == 200
        gate.set()
        assert (await held).status == 200
        assert gateway.app[overload.LIMIT].in_flight == 0


async def test_the_limit_sheds_a_head_that_waited_though_a_place_is_free(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """A head that came while the process was full waits in the backlog (gateway.wire.backlog)
    and, in its turn, is shed as it would have been when it came, even when a call has ended
    since: it is not let in ahead of the heads that come after it. A `/_gateway/` path is
    never shed."""
    async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}]), "1") as gateway:
        limit = gateway.app[overload.LIMIT]
        fields = CIMultiDictProxy(CIMultiDict({"Host": "gateway"}))
        assert limit.in_flight == 0 and not limit.full()
        waited = limit.admit("POST", "/tool/act", "/tool/act", fields, 0.0, waited=True)
        assert isinstance(waited, overload.ShedAnswer)
        assert limit.overloaded("/tool/act", waited=True)
        gateway_path = "/_gateway/healthz"
        assert limit.admit("GET", gateway_path, gateway_path, fields, 0.0, waited=True) is False
        assert not limit.overloaded(gateway_path, waited=True)
        assert limit.in_flight == 0
        assert limit.admit("POST", "/tool/act", "/tool/act", fields, 0.0) is True  # not waited
        assert limit.full()
        limit.abandoned()


async def test_an_mcp_post_is_shed_in_json_rpc_from_its_head(
    tmp_path: Path, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    policy = make_policy(upstream.url, [{"match": "mail/*", "tools": ["send_*"]}], mcp=True)
    async with served(tmp_path, policy, "1") as gateway:
        gate = asyncio.Event()
        upstream.script("/api/mcp", Behavior(gate=gate))
        listing = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}'
        held = asyncio.create_task(
            call(session, "POST", f"{gateway.url}/tool/mcp", data=listing,
                 headers={"Content-Type": "application/json"})
        )  # fmt: skip
        await upstream.wait_received(1)
        made = gateway.requests_made[0]
        reader, writer = await gateway.connect()
        writer.write(fenced_post("/tool/mcp", listing))
        status, headers, body = await read_answer(reader)
        assert status == 503 and headers["content-type"] == "application/json"
        assert headers["retry-after"] == "1"
        answer = json.loads(body)
        assert answer["jsonrpc"] == "2.0" and answer["id"] is None
        assert answer["error"]["code"] == -31050
        assert answer["error"]["data"]["code"] == "overloaded"
        assert gateway.requests_made[0] == made
        writer.close()
        gate.set()
        assert (await held).status == 200


# a request the front does not frame (a chunked body): aiohttp's from then on
TO_AIOHTTP = (
    b"POST /_gateway/healthz HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0\r\n\r\n"
)


@pytest.mark.parametrize("served_by", ["front", "aiohttp"])
async def test_calls_queued_on_a_connection_the_client_closed_are_not_counted_forever(
    tmp_path: Path, upstream: RecordingUpstream, session: aiohttp.ClientSession, served_by: str
) -> None:
    """Pipelined calls that will never be handled (their connection went away while one
    ahead of them held it) hold no slot: aiohttp counts them from their head's arrival and
    gives their slots back; the front reads a pipelined head only once the call ahead of it
    is answered, so it never counted them (a connection that carried a chunked body is
    aiohttp's)."""
    async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}]), "3") as gateway:
        gate = asyncio.Event()
        upstream.script("/api/slow", Behavior(gate=gate))
        reader, writer = await gateway.connect()
        if served_by == "aiohttp":
            writer.write(TO_AIOHTTP)
            await read_answer(reader)  # answered by aiohttp, which keeps the connection
        writer.write(fenced_post("/tool/slow", b"{}") + fenced_post("/tool/next", b"{}"))
        await upstream.wait_received(1)
        limit = gateway.app[overload.LIMIT]
        # the one at the tool, and on aiohttp the one queued behind it
        assert limit.in_flight == (2 if served_by == "aiohttp" else 1)
        writer.close()
        await asyncio.sleep(0.2)
        gate.set()
        for _ in range(100):
            if limit.in_flight == 0:
                break
            await asyncio.sleep(0.05)
        assert limit.in_flight == 0
        assert [r.path_qs for r in upstream.received()] == ["/api/slow"]


@pytest.mark.both_parsers
async def test_on_either_parser_a_shed_call_leaves_its_connection_in_step(
    gateway_factory: GatewayFactory, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    """`fence-gateway serve` itself, on aiohttp's C parser and its pure-Python one: shed calls
    with bodies, alone and pipelined, then the next call on the same connection goes through
    whole."""
    gate = asyncio.Event()
    upstream.script("/api/slow", Behavior(gate=gate))
    gateway = await gateway_factory(
        make_policy(upstream.url, [{"match": "job/*"}]), extra_env={"GATEWAY_MAX_INFLIGHT": "1"}
    )
    held = asyncio.create_task(
        call(session, "POST", f"{gateway.url}/tool/slow", headers=fenced_headers("job/a", 1))
    )
    await upstream.wait_received(1)
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(fenced_post("/tool/one", b'{"n": 1}', X_Request_Id="alone"))
    status, headers, body = await read_answer(reader)
    assert status == 503 and headers["x-request-id"] == "alone"
    assert json.loads(body)["code"] == "overloaded"
    writer.write(fenced_post("/tool/two", b"[2]") + fenced_post("/tool/three", b"[3]"))
    assert [(await read_answer(reader))[0] for _ in range(2)] == [503, 503]
    gate.set()
    assert (await held).status == 200
    writer.write(fenced_post("/tool/four", b'{"n": 4}'))
    assert (await read_answer(reader))[0] == 200
    writer.close()
    assert [(r.path_qs, r.body) for r in upstream.received()][1:] == [("/api/four", b'{"n": 4}')]
