"""An answer that is all in goes to its client in one write (docs/design/performance.md).

Each write to the client's socket is a system call and a wake-up of the client; an answer's
head written apart from its body made two of each for every call. The real app runs in
process (`make_app`) in front of a real recording upstream; the writes counted are those of
aiohttp's server-side writer, on the client's connection.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.http_writer import StreamWriter
from aiohttp.web_protocol import RequestHandler

from tests.harness import AppFactory, RecordingUpstream, make_policy


@pytest.fixture
def server_writes(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[bytes]]:
    """What aiohttp's servers in this process wrote to their clients, by the server's port:
    one item per write to the transport."""
    writes: dict[int, list[bytes]] = {}
    write, writelines = StreamWriter._write, StreamWriter._writelines

    def note(writer: StreamWriter, data: bytes) -> None:
        protocol = writer._protocol
        if isinstance(protocol, RequestHandler) and protocol.transport is not None:
            port = protocol.transport.get_extra_info("sockname")[1]
            writes.setdefault(port, []).append(data)

    def counted_write(self: StreamWriter, chunk: Any) -> None:
        note(self, bytes(chunk))
        write(self, chunk)

    def counted_writelines(self: StreamWriter, chunks: Any) -> None:
        chunks = list(chunks)
        note(self, b"".join(chunks))
        writelines(self, chunks)

    monkeypatch.setattr(StreamWriter, "_write", counted_write)
    monkeypatch.setattr(StreamWriter, "_writelines", counted_writelines)
    return writes


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "plain"])
async def test_a_whole_answer_is_one_write(
    make_app: AppFactory,
    upstream: RecordingUpstream,
    server_writes: dict[int, list[bytes]],
    fenced: bool,
) -> None:
    gw = await make_app(make_policy(upstream.url, [{"match": "res/*"}]))
    headers = {"X-Lease-Resource": "res/a", "X-Fence-Token": "1"} if fenced else {}
    async with gw.client.request(
        "POST" if fenced else "GET", "/tool/act", data=b"{}" if fenced else None, headers=headers
    ) as response:
        body = await response.read()
    assert response.status == 200
    [written] = server_writes[gw.port]
    assert written.startswith(b"HTTP/1.1 200 ") and written.endswith(b"\r\n\r\n" + body)
