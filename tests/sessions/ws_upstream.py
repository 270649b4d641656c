"""A real WebSocket tool for session tests: `WsUpstream` is `RecordingUpstream` (it still
records and answers plain HTTP calls) that also accepts WebSocket upgrades on any path and
records every message it receives, with its arrival time on the test's monotonic clock and
one sequence shared with the HTTP calls and the upgrades, so "no message of the old session
after the newer call (or session)" is a comparison of two numbers.

Per connection it echoes text and binary messages back (`echo`), answers pings with the
same payload, and can be told to refuse upgrades (`refuse`), to stop reading (`reading`), or
to ignore close frames (`answer_close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import time
from typing import Any

from aiohttp import WSMsgType, web
from multidict import CIMultiDict, CIMultiDictProxy

from tests.harness import RecordingUpstream, wait_for


@dataclasses.dataclass
class WsMessage:
    seq: int  # shared with RecordingUpstream's HTTP requests
    connection: int
    kind: str  # text | binary | ping | pong
    data: bytes
    received_at: float  # monotonic


@dataclasses.dataclass
class WsConnection:
    id: int
    seq: int  # the upgrade's place in the sequence shared with messages and HTTP requests
    path_qs: str
    headers: CIMultiDictProxy[str]
    opened_at: float
    ws: web.WebSocketResponse
    messages: list[WsMessage] = dataclasses.field(default_factory=list)
    close_code: int | None = None  # the code of the close frame it received
    close_reason: str | None = None
    ended_at: float | None = None  # monotonic: its connection is gone

    @property
    def fence(self) -> int | None:
        value = self.headers.get("X-Fence-Token")
        return int(value) if value is not None else None

    @property
    def texts(self) -> list[str]:
        return [m.data.decode() for m in self.messages if m.kind == "text"]


@dataclasses.dataclass
class Refusal:
    status: int = 403
    body: bytes = b'{"error": "no session for you"}'
    headers: dict[str, str] = dataclasses.field(
        default_factory=lambda: {"Content-Type": "application/json", "X-Tool": "refused"}
    )


class WsUpstream(RecordingUpstream):
    def __init__(self, *, base_path: str = "/api", tls: ssl.SSLContext | None = None) -> None:
        super().__init__(base_path=base_path, tls=tls)
        self.connections: list[WsConnection] = []
        self.echo = True
        self.reading = True  # False: the tool stops reading its sockets (a slow reader)
        self.answer_close = True  # False: close frames are ignored (the gateway must abort)
        self.refuse: Refusal | None = None
        self.protocol: str | None = None  # the subprotocol it picks, when offered

    # -- views -------------------------------------------------------------------------------

    async def wait_connections(self, count: int, timeout: float = 5.0) -> None:
        await wait_for(lambda: len(self.connections) >= count, timeout=timeout, what="ws")

    async def wait_messages(self, conn: WsConnection, count: int, timeout: float = 5.0) -> None:
        await wait_for(lambda: len(conn.messages) >= count, timeout=timeout, what="messages")

    async def wait_ended(self, conn: WsConnection, timeout: float = 5.0) -> None:
        await wait_for(lambda: conn.ended_at is not None, timeout=timeout, what="ws end")

    # -- the handler -------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return await super()._handle(request)
        if self.refuse is not None:
            self._seq += 1
            return web.Response(
                status=self.refuse.status, body=self.refuse.body, headers=self.refuse.headers
            )
        self._seq += 1
        seq = self._seq
        ws = web.WebSocketResponse(
            autoping=False,
            autoclose=False,
            max_msg_size=0,
            protocols=(self.protocol,) if self.protocol else (),
        )
        await ws.prepare(request)
        conn = WsConnection(
            id=len(self.connections) + 1,
            seq=seq,
            path_qs=request.raw_path,
            headers=CIMultiDictProxy(CIMultiDict(request.headers)),
            opened_at=time.monotonic(),
            ws=ws,
        )
        self.connections.append(conn)
        try:
            await self._serve(conn, request)
        finally:
            conn.ended_at = time.monotonic()
        return ws

    async def _serve(self, conn: WsConnection, request: web.Request) -> None:
        ws = conn.ws
        while True:
            while not self.reading:
                if request.transport is not None:
                    request.transport.pause_reading()
                await asyncio.sleep(0.02)
            if request.transport is not None:
                request.transport.resume_reading()
            message = await ws.receive()
            kind = message.type
            if kind in (WSMsgType.TEXT, WSMsgType.BINARY, WSMsgType.PING, WSMsgType.PONG):
                self._seq += 1
                raw = message.data
                data = raw.encode() if isinstance(raw, str) else bytes(raw)
                name = {
                    WSMsgType.TEXT: "text",
                    WSMsgType.BINARY: "binary",
                    WSMsgType.PING: "ping",
                    WSMsgType.PONG: "pong",
                }[kind]
                conn.messages.append(WsMessage(self._seq, conn.id, name, data, time.monotonic()))
                with contextlib.suppress(ConnectionError, RuntimeError):
                    if kind is WSMsgType.PING:
                        await ws.pong(data)
                    elif self.echo and kind is WSMsgType.TEXT:
                        await ws.send_str(message.data)
                    elif self.echo and kind is WSMsgType.BINARY:
                        await ws.send_bytes(message.data)
            elif kind is WSMsgType.CLOSE:
                conn.close_code, conn.close_reason = message.data, message.extra
                if self.answer_close:
                    with contextlib.suppress(Exception):
                        await ws.close(code=message.data or 1000, message=b"bye")
                    return
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.01)  # never answers; the gateway must abort
                return
            else:
                return


async def send_close(conn: WsConnection, code: int, reason: bytes = b"") -> Any:
    """The tool closes the session itself."""
    return await conn.ws.close(code=code, message=reason)
