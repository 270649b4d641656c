"""The upstream pool at its edges (gateway.wire.pool, gateway.wire.connection): a connection
is reused only when nothing waits unread in its socket and, over TLS, every byte of the last
request has left; a TLS body that runs to the close ends only at the tool's close_notify; a
client certificate the tool refuses in a TLS 1.3 handshake leaves the call `not_sent`."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from multidict import CIMultiDict

from gateway.config.policy import Tls
from gateway.config.tls import ssl_context_for
from gateway.wire.errors import ReadError, ReadTimeout
from gateway.wire.pool import Pool
from tests.harness import fenced_headers, make_policy
from tests.tls.certs import Authority, server_context
from tests.wire.test_framing import fetch


class ThreadTool:
    """A tool on a plain socket in a thread of its own, so that it acts while the test's
    loop is busy. `serve(conn, number)` runs once per accepted connection."""

    def __init__(self, serve: Callable[[socket.socket, int], None]) -> None:
        self._serve = serve
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.requests: list[tuple[int, bytes]] = []  # (connection, request line)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        number = 0
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            number += 1
            threading.Thread(target=self._run, args=(conn, number), daemon=True).start()

    def _run(self, conn: socket.socket, number: int) -> None:
        try:
            self._serve(conn, number)
        except OSError:  # the gateway closed the connection: nothing more to serve
            conn.close()

    def read_request(self, conn: socket.socket, number: int) -> bytes | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        line = data.split(b"\r\n", 1)[0]
        self.requests.append((number, line))
        return line

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def thread_tool() -> Iterator[Callable[[Callable[[socket.socket, int], None]], ThreadTool]]:
    tools: list[ThreadTool] = []

    def start(serve: Callable[[socket.socket, int], None]) -> ThreadTool:
        tools.append(ThreadTool(serve))
        return tools[-1]

    yield start
    for tool in tools:
        tool.close()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def _tls_pool(port: int, authority: Authority, limit: int) -> Pool:
    """A pool to the tool at `port`, which `authority` certified."""
    context = ssl_context_for(Tls(ca_file=str(authority.cert)))
    return Pool(
        "127.0.0.1",
        port,
        limit=limit,
        connect_timeout_s=2,
        tls=context,
        server_hostname="127.0.0.1",
    )


def _tls_accept(served: ssl.SSLContext, raw: socket.socket) -> ssl.SSLSocket | None:
    """The tool's side of a TLS connection; None (closed) when the handshake fails."""
    try:
        return served.wrap_socket(raw, server_side=True)
    except (OSError, ssl.SSLError):
        raw.close()
        return None


async def test_stale_bytes_not_yet_read_on_an_idle_connection_are_not_the_next_answer(
    thread_tool,
) -> None:
    """The tool writes an answer nobody asked for while the connection sits idle; the bytes
    are in the gateway's socket, but the loop (busy: here, a blocking pause) has not read
    them yet when the next call takes the connection. They must never become that call's
    answer: the connection is not reused, the call goes on a new one and gets its own."""

    def serve(conn: socket.socket, number: int) -> None:
        with conn:
            while tool.read_request(conn, number) is not None:
                if number == 1:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
                    time.sleep(0.05)
                    conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 7\r\n\r\nsmuggle")
                else:
                    conn.sendall(OK)

    tool = thread_tool(serve)
    pool = Pool("127.0.0.1", tool.port, limit=4, connect_timeout_s=2)
    try:
        assert (await fetch(pool, "/first"))[2] == b"hello"
        time.sleep(0.3)  # a busy loop: the smuggled answer is in the socket, unread
        status, _, body = await fetch(pool, "/second", method="POST")
        assert (status, body) == (200, b"ok")
    finally:
        await pool.close()


async def test_an_idle_connection_closed_while_the_loop_was_busy_is_not_written_to(
    thread_tool,
) -> None:
    """The tool closes a keep-alive connection while it is idle (its keep-alive timeout);
    the FIN is in the gateway's socket but the loop has not read it yet. The next call must
    not be written to that dead connection (it would fail as outcome unknown, a call the
    tool never saw): it is sent once, on a new connection."""

    def serve(conn: socket.socket, number: int) -> None:
        with conn:
            if tool.read_request(conn, number) is not None:
                conn.sendall(OK)
            if number == 1:
                conn.shutdown(socket.SHUT_WR)  # closes at once after its one answer
                time.sleep(0.5)
                return
            while tool.read_request(conn, number) is not None:
                conn.sendall(OK)

    tool = thread_tool(serve)
    pool = Pool("127.0.0.1", tool.port, limit=4, connect_timeout_s=2)
    try:
        assert (await fetch(pool, "/first"))[2] == b"ok"
        time.sleep(0.2)  # a busy loop: the tool's FIN has arrived, unread
        try:
            status, _, body = await fetch(pool, "/second", method="POST")
        except ReadError as exc:
            pytest.fail(f"a call written to a connection known closed: {exc}")
        assert (status, body) == (200, b"ok")
        assert [n for n, _ in tool.requests] == [1, 2]
    finally:
        await pool.close()


async def test_a_close_delimited_body_cut_without_close_notify_is_broken_over_tls(
    thread_tool, tmp_path
) -> None:
    """Over TLS, the end of a body that runs until the close is the tool's close_notify; a
    bare TCP FIN before it (a truncation on the way, or a tool that died) says nothing about
    where the body ended. Taken as its end, a cut answer looks whole: kept for replay and
    recorded as the tool's whole answer. It is a broken answer (`ReadError`)."""
    authority = Authority(tmp_path / "ca")
    served = server_context(authority.issue("tool"))

    def serve(raw: socket.socket, number: int) -> None:
        conn = _tls_accept(served, raw)
        if conn is None:
            return
        with conn:
            if tool.read_request(conn, number) is not None:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npart of")
                time.sleep(0.1)
                # the TCP connection ends here, without the TLS close_notify
                socket.socket.shutdown(conn, socket.SHUT_WR)
                time.sleep(0.5)

    tool = thread_tool(serve)
    pool = _tls_pool(tool.port, authority, limit=1)
    try:
        deadline = asyncio.get_running_loop().time() + 5
        async with await pool.send(
            "GET", "/doc", CIMultiDict(Host="tool"), None, deadline
        ) as answer:
            assert answer.status == 200
            chunks = []
            with pytest.raises(ReadError):
                while chunk := await answer.read():
                    chunks.append(chunk)
                pytest.fail(f"a truncated body taken whole: {b''.join(chunks)!r}")
    finally:
        await pool.close()


async def test_a_tls_connection_with_request_bytes_still_unsent_is_not_reused(
    thread_tool, tmp_path
) -> None:
    """The tool answers before reading the whole body, keeps the connection, and reads no
    more. Over plain HTTP the pool sees the body still waiting to be written and does not
    reuse the connection; over TLS neither (the TLS transport's write buffer size leaves out
    what the TCP transport holds): the next call sat behind a body the tool does not read,
    and timed out as outcome unknown, a call the tool never saw."""
    authority = Authority(tmp_path / "ca")
    served = server_context(authority.issue("tool"))
    done = threading.Event()

    def serve(raw: socket.socket, number: int) -> None:
        conn = _tls_accept(served, raw)
        if conn is None:
            return
        with conn:
            while tool.read_request(conn, number) is not None:
                conn.sendall(OK)
                if number == 1:
                    done.wait(10)  # reads nothing more on this connection
                    return

    tool = thread_tool(serve)
    pool = _tls_pool(tool.port, authority, limit=4)
    loop = asyncio.get_running_loop()
    headers = CIMultiDict(Host="tool")
    try:
        async with await pool.send(
            "POST", "/big", headers, b"x" * 32_000_000, loop.time() + 5
        ) as answer:
            assert (answer.status, await answer.read()) == (200, b"ok")
        try:
            async with await pool.send("GET", "/next", headers, None, loop.time() + 2) as answer:
                assert (answer.status, await answer.read()) == (200, b"ok")
        except ReadTimeout:
            pytest.fail("the next call went behind an unread body, on the same connection")
        assert [n for n, _ in tool.requests] == [1, 2]
    finally:
        done.set()
        await pool.close()


async def test_a_client_certificate_the_tool_refuses_is_not_sent_not_outcome_unknown(
    thread_tool, make_app, tmp_path
) -> None:
    """docs/contract.md §3 and §22: a TLS handshake that fails is `not_sent`, 502
    `upstream_unreachable`. With TLS 1.3 the tool checks the client certificate after the
    gateway's side of the handshake is done, so its refusal (an alert: certificate required,
    unknown CA) arrives after the request was written; but the tool's TLS layer never let
    those bytes through. Such a call is `not_sent`, not `outcome_unknown` (a reconciliation
    for every call, while a client certificate is missing, expired or from the wrong CA)."""
    tool_ca = Authority(tmp_path / "tool-ca", "Tool CA")
    clients = Authority(tmp_path / "clients", "Clients CA")
    served = server_context(tool_ca.issue("tool"), client_ca=clients.cert)

    def serve(raw: socket.socket, number: int) -> None:
        conn = served.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        try:
            conn.do_handshake()
        except (OSError, ssl.SSLError):
            # its alert is sent; then a lingering close (what came is read and dropped),
            # so that no reset overtakes the alert
            with conn:
                socket.socket.shutdown(conn, socket.SHUT_WR)
                conn.settimeout(2)
                while socket.socket.recv(conn, 65536):
                    pass
            return
        with conn:
            while tool.read_request(conn, number) is not None:
                conn.sendall(OK)

    tool = thread_tool(serve)
    gw = await make_app(
        make_policy(
            f"https://127.0.0.1:{tool.port}/api",
            [{"match": "r/*"}],
            tls={"ca_file": str(tool_ca.cert)},  # no client certificate
        )
    )
    async with gw.client.post("/tool/act", data=b"{}", headers=fenced_headers("r/a", 1)) as resp:
        body = await resp.json()
        receipt = await gw.receipt(resp.headers["X-Receipt-Id"])
    assert tool.requests == []  # the tool's TLS layer never passed the request on
    assert (resp.status, body["code"], receipt["status"]) == (
        502,
        "upstream_unreachable",
        "not_sent",
    ), (body, receipt)
