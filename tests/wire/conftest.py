"""A tool on a raw socket for the wire's tests: it answers each request with the bytes (or
the script) given for its path, and notes which connection every request came on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import pytest

from gateway.wire.pool import Pool

Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


@dataclass
class ScriptedTool:
    answers: Mapping[str, bytes | Script]
    requests: list[tuple[int, bytes]] = field(default_factory=list)  # (connection, head+body)
    port: int = 0
    _server: asyncio.Server | None = None
    _connections: int = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    @property
    def connections(self) -> list[int]:
        """The connection each request came on, in order."""
        return [number for number, _ in self.requests]

    def pool(self, limit: int = 4, connect_timeout_s: float = 2.0) -> Pool:
        return Pool("127.0.0.1", self.port, limit=limit, connect_timeout_s=connect_timeout_s)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        number = self._connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                self.requests.append((number, head + body))
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


Start = Callable[[Mapping[str, bytes | Script]], Awaitable[ScriptedTool]]


@pytest.fixture
async def scripted() -> AsyncIterator[Start]:
    """`tool = await scripted({"/path": answer, ...})`: started, closed at teardown."""
    tools: list[ScriptedTool] = []

    async def start(answers: Mapping[str, bytes | Script]) -> ScriptedTool:
        tool = ScriptedTool(answers)
        await tool.start()
        tools.append(tool)
        return tool

    yield start
    for tool in tools:
        await tool.close()
