"""The store contract for MCP tool calls (docs/contract.md §16), on every backend: an
admitted tool call's receipt and a refused one's keep `mcp` (tool and JSON-RPC id); every
other receipt says `mcp: null`."""

import dataclasses

from gateway.core.mcp import McpRecord
from gateway.store.base import Admitted, Refused, Rejection
from tests.store.test_contract import call


class TestMcpReceipts:
    async def test_tool_calls_keep_their_tool_and_id(self, store) -> None:
        record = McpRecord("send_email", "req-7")
        admitted = await store.admit(dataclasses.replace(call(5), mcp=record))
        assert isinstance(admitted, Admitted)
        receipt = (await store.get_receipt(admitted.receipt_id)).to_json()
        assert receipt["mcp"] == {"tool": "send_email", "jsonrpc_id": "req-7"}
        stale = await store.admit(dataclasses.replace(call(4), mcp=McpRecord("send_email", 8)))
        assert isinstance(stale, Refused) and stale.code == "stale_fence"
        refused = (await store.get_receipt(stale.receipt_id)).to_json()
        assert refused["mcp"] == {"tool": "send_email", "jsonrpc_id": 8}
        rejected_id = await store.reject(
            Rejection(
                "acct/1",
                6,
                None,
                None,
                "tool",
                "POST",
                "/mcp",
                "missing_fence",
                428,
                mcp=McpRecord("deploy", 9),
            )
        )
        rejected = (await store.get_receipt(rejected_id)).to_json()
        assert rejected["mcp"] == {"tool": "deploy", "jsonrpc_id": 9}

    async def test_other_receipts_say_null(self, store) -> None:
        admitted = await store.admit(call(5))
        assert isinstance(admitted, Admitted)
        assert (await store.get_receipt(admitted.receipt_id)).to_json()["mcp"] is None
