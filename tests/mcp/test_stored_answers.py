"""What of an MCP tool call's answer is kept for replay (docs/contract.md §4, §16): only a
whole answer within `replay_max_bytes`, whatever its status; a larger one is refused on a
retry as `already_completed`, as on the plain path."""

from __future__ import annotations

import json

from tests.harness import AppFactory, Behavior, RecordingUpstream, make_policy

MOUNT = "/mail"


async def test_a_refusal_larger_than_replay_max_bytes_is_not_replayed(
    make_app: AppFactory, upstream: RecordingUpstream
) -> None:
    big = {"jsonrpc": "2.0", "id": 1, "error": {"code": -32603, "message": "x" * 4000}}
    upstream.default = Behavior(status=500, body=json.dumps(big).encode())
    rule = {"match": "mail/*", "tools": ["send_*"], "idempotency": {"replay_max_bytes": 1024}}
    gw = await make_app(make_policy(upstream.url, [rule], name="mail", mount=MOUNT, mcp=True))
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "send_email", "arguments": {"to": "a", "text": "b"}},
    }
    lease = {"X-Lease-Resource": "mail/big", "X-Fence-Token": "3"}
    status, _, _ = await gw.send("POST", f"{MOUNT}/mcp", json=call, headers=lease)
    assert status == 500
    status, headers, body = await gw.send("POST", f"{MOUNT}/mcp", json=call, headers=lease)
    assert headers.get("Idempotent-Replayed") != "true"
    assert status == 409 and body["error"]["data"]["code"] == "already_completed"
    assert len(upstream.received()) == 1
