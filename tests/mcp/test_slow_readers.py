"""A client slow to read an MCP tool call's SSE answer does not decide its outcome
(docs/contract.md §16): the tool's `timeout_s` bounds the tool, not the client. While the
client does not read the events before the answer, the tool is not read either, and that time
is not counted against the tool, up to GATEWAY_RECONCILE_GRACE_S. A client still not reading
then is cut as one that left; the tool's stream is read on without it, and a retry of the call
is answered from its receipt."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.harness import AppFactory, Behavior, RecordingUpstream, make_policy

MOUNT = "/mail"
ANSWER = b'{"jsonrpc":"2.0","id":1,"result":{"content":[]}}'
# progress events, 64 KiB each, 16 MiB in all: more than the sockets on the way hold
PROGRESS = (
    b'data: {"jsonrpc":"2.0","method":"notifications/progress","params":'
    b'{"progressToken":"p","progress":1,"message":"%s"}}\n\n' % (b"x" * 65_000)
)
EVENTS = 256
LEASE = {"X-Lease-Resource": "mail/s", "X-Fence-Token": "3"}
BODY = json.dumps(
    {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "send_email", "arguments": {"to": "a", "text": "t"}},
    }
).encode()
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


async def _read_late(url: str, stall_s: float) -> tuple[bytes, bytes]:
    """The call from a client whose socket takes little and that reads nothing for
    `stall_s` once the answer's head is in: the head, then all the rest it is sent."""
    address = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (address.hostname, address.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=2**20)
    fields = {**HEADERS, **LEASE, "Content-Length": str(len(BODY)), "Connection": "close"}
    head = f"POST {MOUNT}/mcp HTTP/1.1\r\nHost: {address.netloc}\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in fields.items()
    )
    writer.write(head.encode() + b"\r\n" + BODY)
    answer_head = await reader.readuntil(b"\r\n\r\n")
    await asyncio.sleep(stall_s)
    rest = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return answer_head, rest


@pytest.mark.parametrize(
    ("grace_s", "relayed"),
    [(10.0, True), (0.5, False)],
    ids=["within_the_grace", "past_the_grace_cut"],
)
async def test_a_client_that_reads_late_does_not_make_an_answered_call_unknown(
    make_app: AppFactory, upstream: RecordingUpstream, grace_s: float, relayed: bool
) -> None:
    upstream.default = Behavior(
        body=PROGRESS * EVENTS + b"data: " + ANSWER + b"\n\n",
        headers={"Content-Type": "text/event-stream"},
    )
    rule: dict[str, Any] = {"match": "mail/*", "tools": ["send_*"]}
    policy = make_policy(upstream.url, [rule], name="mail", mount=MOUNT, mcp=True, timeout_s=1)
    gw = await make_app(policy, reconcile_grace_s=grace_s)

    head, rest = await _read_late(gw.url, stall_s=2.5)  # past the tool's timeout_s

    assert head.startswith(b"HTTP/1.1 200 "), head
    receipt_id = next(
        line.partition(b":")[2].strip().decode()
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"x-receipt-id:")
    )
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/_gateway/v1/receipts/{receipt_id}") as got:
            receipt = await got.json()
        assert (receipt["status"], receipt.get("error")) == ("succeeded", None)
        if relayed:  # every event, then the answer
            assert rest.count(b"notifications/progress") == EVENTS and ANSWER in rest
        else:
            assert ANSWER not in rest
        async with session.post(
            f"{gw.url}{MOUNT}/mcp", data=BODY, headers={**HEADERS, **LEASE}
        ) as again:
            assert again.headers.get("Idempotent-Replayed") == "true"
            assert json.loads(await again.read()) == json.loads(ANSWER)
    assert len(upstream.requests) == 1
