"""Raw HTTP/1.1 for hostile-input tests, both ways.

To the gateway, over plain blocking sockets: send bytes exactly as given, read back every
answer the gateway gives on that connection, and say whether the connection hung. Blocking
sockets keep this usable from a thread (hypothesis runs its examples there) while the test's
event loop goes on serving the recording upstream.

From the tool (`WireTool`): answers written byte for byte, framed right or wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any


@dataclasses.dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    to_head: bool = False  # an answer to HEAD: its body (a problem's too) is never sent

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    @property
    def problem(self) -> dict[str, Any] | None:
        """The problem+json document, when the answer is one."""
        if (self.header("Content-Type") or "").split(";")[0].strip() != "application/problem+json":
            return None
        try:
            document = json.loads(self.body)
        except ValueError:
            return None
        return document if isinstance(document, dict) else None


@dataclasses.dataclass
class Exchange:
    answers: list[Answer]
    closed: bool  # the gateway closed the connection (or reset it)
    hung: bool  # no answer and no close within the deadline
    seconds: float


class _Incomplete(Exception):
    """More bytes are needed to parse the next answer."""


def _parse(buffer: bytes, head_only: bool, at_eof: bool) -> tuple[Answer, bytes]:
    """One answer from the front of `buffer`, and the rest."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        raise _Incomplete
    lines = buffer[:end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    status = int(parts[1])
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    rest = buffer[end + 4 :]
    answer = Answer(status, headers, b"", to_head=head_only)
    if head_only or status < 200 or status in (204, 304):
        return answer, rest
    if "chunked" in (answer.header("Transfer-Encoding") or "").lower():
        body = b""
        while True:
            line_end = rest.find(b"\r\n")
            if line_end < 0:
                raise _Incomplete
            size = int(rest[:line_end].split(b";")[0].strip(), 16)
            if len(rest) < line_end + 2 + size + 2:
                raise _Incomplete
            body += rest[line_end + 2 : line_end + 2 + size]
            rest = rest[line_end + 2 + size + 2 :]
            if size == 0:
                answer.body = body
                return answer, rest
    length = answer.header("Content-Length")
    if length is None:  # until the connection closes
        if not at_eof:
            raise _Incomplete
        answer.body = rest
        return answer, b""
    if len(rest) < int(length):
        raise _Incomplete
    answer.body = rest[: int(length)]
    return answer, rest[int(length) :]


def exchange(
    port: int,
    payload: bytes,
    *,
    head_first: bool = False,
    deadline_s: float = 5.0,
    idle_s: float = 0.3,
) -> Exchange:
    """Send `payload` on a new connection; read answers until the gateway closes, or for
    `idle_s` after a complete answer nothing more comes. `hung`: neither an answer nor a close
    within `deadline_s`. `head_first`: the first answer is to a HEAD (no body follows)."""
    started = time.monotonic()
    answers: list[Answer] = []
    buffer, closed = b"", False
    with socket.create_connection(("127.0.0.1", port), timeout=deadline_s) as sock:
        with contextlib.suppress(OSError):  # the gateway may close before it read it all
            sock.sendall(payload)
        while True:
            while True:  # every complete answer in what arrived so far
                try:
                    answer, buffer = _parse(buffer, head_first and not answers, closed)
                except _Incomplete:
                    break
                if answer.status >= 200:  # 1xx answers are interim
                    answers.append(answer)
            if closed:
                break
            elapsed = time.monotonic() - started
            if elapsed > deadline_s:
                return Exchange(answers, False, not answers, elapsed)
            sock.settimeout(idle_s if answers else deadline_s - elapsed)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if answers:
                    break
                continue
            except OSError:  # reset
                chunk = b""
            buffer += chunk
            if not chunk:
                closed = True
    return Exchange(answers, closed, False, time.monotonic() - started)


def request(
    method: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes = b"",
    *,
    version: bytes = b"HTTP/1.1",
    newline: bytes = b"\r\n",
) -> bytes:
    """A request head and body exactly as given: nothing added, nothing checked."""
    lines = [method + b" " + target + b" " + version]
    lines += [name + b":" + value for name, value in headers]
    return newline.join(lines) + newline + newline + body


# What a tool writes as its answer, on the connection the request came on.
Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


class WireTool:
    """A tool answering in raw HTTP/1.1, by request path: the bytes given, or what a script
    writes (answers aiohttp's server will not produce, or that break HTTP). It reads each
    request, its head and a Content-Length body, and keeps every head and the connection it
    came on (1 for the first connection, 2 for the next, ...)."""

    def __init__(self, answers: Mapping[str, bytes | Script]) -> None:
        self.answers = answers
        self.heads: list[bytes] = []
        self.connections: list[int] = []  # the connection of each head in `heads`
        self._accepted = 0
        self.port: int | None = None
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def __aenter__(self) -> WireTool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._accepted += 1
        connection = self._accepted
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                self.connections.append(connection)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                answer = self.answers[head.split(b" ")[1].decode()]
                if isinstance(answer, bytes):
                    writer.write(answer)
                else:
                    await answer(writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
