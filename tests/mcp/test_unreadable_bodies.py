"""An MCP POST whose body the gateway cannot read as JSON (docs/contract.md §16): refused, not
passed on unfenced, since a server with another JSON reader could read a tool call in it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.harness import AppFactory, Behavior, Recorded, RecordingUpstream, make_policy

MOUNT = "/mail"


def mcp_rules(upstream: RecordingUpstream) -> dict[str, Any]:
    rule: dict[str, Any] = {"match": "mail/*", "tools": ["send_*"]}
    return make_policy(upstream.url, [rule], name="mail", mount=MOUNT, mcp=True)


def answering(rec: Recorded) -> Behavior:
    """A lenient MCP server: reads the body as UTF-8 with replacement (as a TextDecoder or
    Express's body parser does) and answers the request's id."""
    try:
        message = json.loads(rec.body.decode("utf-8", "replace"))
        request_id = message.get("id") if isinstance(message, dict) else None
    except ValueError:
        request_id = None
    body = {"jsonrpc": "2.0", "id": request_id, "result": {"content": []}}
    return Behavior(body=json.dumps(body).encode())


@pytest.mark.parametrize(
    "body",
    [
        # an invalid UTF-8 byte in an argument: Python's json refuses it, a server that
        # decodes with replacement (TypeScript SDK, Express) runs the tool
        b'{"jsonrpc":"2.0","id":1,"method":"tools/call",'
        b'"params":{"name":"send_email","arguments":{"to":"bob\xff","text":"hi"}}}',
        # trailing bytes after the message: a streaming decoder (Go's json.Decoder) reads the
        # first value and runs it
        b'{"jsonrpc":"2.0","id":1,"method":"tools/call",'
        b'"params":{"name":"send_email","arguments":{"to":"bob","text":"hi"}}}\n{}',
        # valid JSON (RFC 8259 sets no limit on a number's digits) that Python's json refuses
        # (int_max_str_digits, 4300): JSON.parse reads it
        b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send_email",'
        b'"arguments":{"to":"bob","text":"hi"},"_meta":{"pad":' + b"1" * 4301 + b"}}}",
    ],
    ids=["invalid_utf8", "trailing_bytes", "valid_json_4301_digit_number"],
)
async def test_a_body_the_gateway_cannot_read_is_refused_not_passed_on(
    make_app: AppFactory, upstream: RecordingUpstream, body: bytes
) -> None:
    upstream.default = answering
    gw = await make_app(mcp_rules(upstream))
    # no lease at all: a fenced tool (send_*) must never reach the server without a fence
    async with gw.client.post(
        f"{MOUNT}/mcp", data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        status, answer = resp.status, await resp.json()
    assert status == 400 and upstream.received() == []
    # refused in the client's protocol: a JSON-RPC error, with no id to answer
    assert (answer["id"], answer["error"]["data"]["code"]) == (None, "invalid_request")
