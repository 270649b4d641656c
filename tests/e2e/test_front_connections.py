"""Which side of the server answers each request on a connection (docs/design/architecture.md,
"The front"): the front serves proxied calls it frames itself, lends one request at a time
to aiohttp's protocol (a `/_gateway/` call, a 404) and takes the connection back after it,
and gives a connection to aiohttp for good at a request it cannot frame (a chunked body).
Whoever answers, the answers come in the order the requests were sent, and a call in progress
is answered before the server stops."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.e2e.served import Served, fenced_post, read_answer, served
from tests.harness import Behavior, RecordingUpstream, make_policy

HEALTHZ = b"GET /_gateway/healthz HTTP/1.1\r\nHost: gateway\r\n\r\n"
PLAIN_GET = b"GET /tool/items HTTP/1.1\r\nHost: gateway\r\n\r\n"
CHUNKED = (
    b"POST /tool/chunked HTTP/1.1\r\nHost: gateway\r\nX-Lease-Resource: job/c\r\n"
    b"X-Fence-Token: 7\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
)


def by_front(gateway: Served) -> int:
    return gateway.requests_made[0] - gateway.by_aiohttp[0]


class TestWhoAnswers:
    """The front serves what it frames; aiohttp answers the rest, lent or for good."""

    async def test_proxied_calls_on_a_fresh_connection_are_the_fronts(
        self, tmp_path: Path, upstream: RecordingUpstream
    ) -> None:
        async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}])) as gateway:
            reader, writer = await gateway.connect()
            writer.write(fenced_post("/tool/act", b'{"n": 1}') + PLAIN_GET)
            assert (await read_answer(reader))[0] == 200
            assert (await read_answer(reader))[0] == 200
            assert (by_front(gateway), gateway.by_aiohttp[0]) == (2, 0)
            writer.close()
        assert [r.path_qs for r in upstream.received()] == ["/api/act", "/api/items"]

    async def test_a_gateway_call_is_lent_to_aiohttp_and_the_connection_comes_back(
        self, tmp_path: Path, upstream: RecordingUpstream
    ) -> None:
        """The gateway's own client library mixes lease calls and proxied calls on one
        connection: the proxied calls after a lease call are the front's again."""
        async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}])) as gateway:
            reader, writer = await gateway.connect()
            for n in range(3):
                writer.write(HEALTHZ)
                status, _, body = await read_answer(reader)
                assert (status, body) == (200, b'{"status": "ok"}')
                writer.write(fenced_post("/tool/act", b'{"n": %d}' % n))
                assert (await read_answer(reader))[0] == 200
            assert (by_front(gateway), gateway.by_aiohttp[0]) == (3, 3)
            writer.close()

    async def test_a_lent_request_answered_before_its_body_came_gives_the_connection_back(
        self, tmp_path: Path, upstream: RecordingUpstream
    ) -> None:
        """aiohttp answers a bad checkpoint write from its head; the connection comes back
        once the rest of the body has come (aiohttp reads it), at the next request."""
        async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}])) as gateway:
            reader, writer = await gateway.connect()
            writer.write(
                b"PUT /_gateway/v1/checkpoints/job/x HTTP/1.1\r\nHost: gateway\r\n"
                b"X-Fence-Token: not-a-number\r\nContent-Type: application/json\r\n"
                b'Content-Length: 20\r\n\r\n{"state": '
            )
            status, _, _ = await read_answer(reader)
            assert status == 400
            writer.write(b'"half"}   ' + fenced_post("/tool/act", b'{"n": 1}'))
            assert (await read_answer(reader))[0] == 200
            assert (by_front(gateway), gateway.by_aiohttp[0]) == (1, 1)
            writer.close()

    async def test_a_route_nobody_mounted_is_lent_and_answered_404(
        self, tmp_path: Path, upstream: RecordingUpstream
    ) -> None:
        async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}])) as gateway:
            reader, writer = await gateway.connect()
            writer.write(b"GET /nowhere HTTP/1.1\r\nHost: gateway\r\n\r\n" + PLAIN_GET)
            status, headers, _ = await read_answer(reader)
            assert status == 404 and headers["content-type"].startswith("application/problem")
            assert (await read_answer(reader))[0] == 200
            assert (by_front(gateway), gateway.by_aiohttp[0]) == (1, 1)
            writer.close()

    async def test_a_chunked_body_gives_the_connection_to_aiohttp_for_good(
        self, tmp_path: Path, upstream: RecordingUpstream
    ) -> None:
        async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}])) as gateway:
            reader, writer = await gateway.connect()
            writer.write(CHUNKED)
            assert (await read_answer(reader))[0] == 200
            writer.write(fenced_post("/tool/act", b'{"n": 1}'))
            assert (await read_answer(reader))[0] == 200
            assert (by_front(gateway), gateway.by_aiohttp[0]) == (0, 2)
            writer.close()
        assert [r.body for r in upstream.received()] == [b"{}", b'{"n": 1}']

    async def test_a_pipelined_mix_is_answered_in_order(
        self, tmp_path: Path, upstream: RecordingUpstream
    ) -> None:
        """Each answer comes after the one before it is written, whoever writes it; the
        slow call at the tool holds the rest back."""
        gate = asyncio.Event()
        upstream.script("/api/slow", Behavior(gate=gate))
        async with served(tmp_path, make_policy(upstream.url, [{"match": "job/*"}])) as gateway:
            reader, writer = await gateway.connect()
            writer.write(
                fenced_post("/tool/slow", b"{}")
                + HEALTHZ
                + PLAIN_GET
                + b"GET /nowhere HTTP/1.1\r\nHost: gateway\r\n\r\n"
                + fenced_post("/tool/last", b"{}")
            )
            await upstream.wait_received(1)
            await asyncio.sleep(0.2)
            assert len(upstream.received()) == 1  # nothing behind the slow call has begun
            gate.set()
            answers = [await read_answer(reader) for _ in range(5)]
            assert [status for status, _, _ in answers] == [200, 200, 200, 404, 200]
            assert answers[1][2] == b'{"status": "ok"}'
            writer.close()
        assert [r.path_qs for r in upstream.received()] == ["/api/slow", "/api/items", "/api/last"]


class TestStopping:
    """A call in progress on a front connection is answered before the server stops."""

    async def test_a_call_in_progress_is_drained(
        self, tmp_path: Path, upstream: RecordingUpstream
    ) -> None:
        gate = asyncio.Event()
        upstream.script("/api/slow", Behavior(gate=gate))
        policy = make_policy(upstream.url, [{"match": "job/*"}])
        stopping = None
        async with served(tmp_path, policy) as gateway:
            reader, writer = await gateway.connect()
            idle_reader, _ = await gateway.connect()
            writer.write(fenced_post("/tool/slow", b"{}"))
            await upstream.wait_received(1)
            answer = asyncio.create_task(read_answer(reader))
            loop = asyncio.get_running_loop()
            loop.call_later(0.5, gate.set)  # the tool answers while the server stops
            stopping = loop.time()
        # the server has stopped: the call was answered, and the idle connection closed
        assert (await answer)[0] == 200
        assert loop.time() - stopping >= 0.4
        assert await asyncio.wait_for(idle_reader.read(), 5) == b""
