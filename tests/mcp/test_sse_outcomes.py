"""The outcome of an MCP tool call answered in server-sent events (docs/contract.md §16): the
event answering the call decides it, however the stream's lines end and whether it starts with
a byte order mark (the HTML standard's decoder strips one)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.harness import AppFactory, Behavior, RecordingUpstream, make_policy

MOUNT = "/mail"


def mcp_rules(upstream: RecordingUpstream) -> dict[str, Any]:
    rule: dict[str, Any] = {"match": "mail/*", "tools": ["send_*"]}
    return make_policy(upstream.url, [rule], name="mail", mount=MOUNT, mcp=True)


def _sse(*events: bytes) -> Behavior:
    return Behavior(body=b"".join(events), headers={"Content-Type": "text/event-stream"})


ANSWER = b'{"jsonrpc":"2.0","id":1,"result":{"content":[]}}'
PROGRESS = (
    b'{"jsonrpc":"2.0","method":"notifications/progress",'
    b'"params":{"progressToken":"p","progress":1}}'
)


@pytest.mark.parametrize(
    ("stream", "status"),
    [
        (_sse(b"data: " + PROGRESS + b"\n\n", b"data: " + ANSWER + b"\n\n"), "succeeded"),
        (
            _sse(b'data: {"jsonrpc":"2.0","id":1,"error":{"code":-32602,"message":"no"}}\n\n'),
            "failed",
        ),
        # the HTML standard's line ends include a lone CR: "data: …" CR CR is a whole event
        (_sse(b"data: " + PROGRESS + b"\r\r", b"data: " + ANSWER + b"\r\r"), "succeeded"),
        # the standard's decoder strips one leading BOM from the stream
        (_sse(b"\xef\xbb\xbfdata: " + ANSWER + b"\n\n"), "succeeded"),
    ],
    ids=["progress_then_result", "jsonrpc_error", "cr_line_ends", "leading_bom"],
)
async def test_the_outcome_of_an_sse_answer(
    make_app: AppFactory, upstream: RecordingUpstream, stream: Behavior, status: str
) -> None:
    upstream.default = stream
    gw = await make_app(mcp_rules(upstream))
    lease = {"X-Lease-Resource": "mail/s", "X-Fence-Token": "3"}
    receipt_id = None
    try:
        async with gw.client.post(f"{MOUNT}/mcp", json=_call(1, "a"), headers=lease) as resp:
            receipt_id = resp.headers.get("X-Receipt-Id")
            received = await resp.read()
    except Exception as exc:  # a cut stream
        received = repr(exc).encode()
    assert receipt_id is not None
    async with (
        aiohttp.ClientSession() as fresh,  # the call's connection may have been cut
        fresh.get(f"{gw.url}/_gateway/v1/receipts/{receipt_id}") as got,
    ):
        receipt = await got.json()
    assert (receipt["status"], receipt.get("error")) == (status, None), received


def _call(request_id: Any, to: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": "send_email", "arguments": {"to": to, "text": "t"}},
    }
