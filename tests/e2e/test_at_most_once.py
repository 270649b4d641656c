"""Each admitted call is sent upstream at most once, also when the connection drops mid-call.

docs/contract.md §2 ("the gateway never retries by itself"; aiohttp's client silently resends
idempotent methods on a reused keep-alive connection unless told not to) and the outcome table
of §3 ("reset or broken answer after the request was sent": `outcome_unknown`,
`502 upstream_outcome_unknown`).
"""

from __future__ import annotations

import pytest

from tests.harness import (
    Behavior,
    GatewayFactory,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    make_policy,
    pick,
    problem,
)


class TestConnectionDroppedAfterRequest:
    """The upstream reads a PUT or DELETE and closes the connection without answering."""

    @pytest.mark.parametrize("how", ["close", "abort"])
    async def test_put_and_delete_reach_the_tool_once_and_end_outcome_unknown(
        self,
        how: str,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session,
    ) -> None:
        gateway = await gateway_factory(make_policy(upstream.url, [{"match": "once/*"}]))
        resource = "once/r1"
        upstream.script("/api/items/1", Behavior(action=how))
        headers = fenced_headers(resource, 1, owner="worker-1")

        results = {}
        for method, warmup_path in (("PUT", "/tool/warm-1"), ("DELETE", "/tool/warm-2")):
            # A successful call first leaves a keep-alive connection in the gateway's pool:
            # the dropped call then goes out on a reused connection, where aiohttp would retry.
            warm = await call(
                session, "POST", gateway.url + warmup_path, data=b'{"warm": 1}', headers=headers
            )
            assert warm.status == 200, warm
            dropped = await call(
                session,
                method,
                f"{gateway.url}/tool/items/1",
                data=b'{"item": 1}' if method == "PUT" else None,
                headers=headers,
            )
            results[method] = pick(problem(dropped), ("status", "code", "resource", "fence"))

        assert results == {
            method: {
                "status": 502,
                "code": "upstream_outcome_unknown",
                "resource": resource,
                "fence": 1,
            }
            for method in ("PUT", "DELETE")
        }

        # Exactly once each: no silent resend on a fresh connection.
        assert [(r.method, r.path) for r in upstream.requests] == [
            ("POST", "/api/warm-1"),
            ("PUT", "/api/items/1"),
            ("POST", "/api/warm-2"),
            ("DELETE", "/api/items/1"),
        ]
        # Precondition of the scenario: each dropped call went out on the keep-alive connection
        # its warm-up call had used (same gateway-side socket), where aiohttp would resend.
        reused = [upstream.requests[i].peer == upstream.requests[i - 1].peer for i in (1, 3)]
        assert reused == [True, True], "the dropped calls did not reuse a pooled connection"

        receipts = sorted(
            await fetch_receipts(session, gateway.url, resource=resource), key=lambda r: r["id"]
        )
        fields = ("method", "path", "fence", "status", "reject_code", "attempt")
        assert [pick(r, fields) for r in receipts] == [
            {
                "method": "POST",
                "path": "/warm-1",
                "fence": 1,
                "status": "succeeded",
                "reject_code": None,
                "attempt": 1,
            },
            {
                "method": "PUT",
                "path": "/items/1",
                "fence": 1,
                "status": "outcome_unknown",
                "reject_code": None,
                "attempt": 1,
            },
            {
                "method": "POST",
                "path": "/warm-2",
                "fence": 1,
                "status": "succeeded",
                "reject_code": None,
                "attempt": 1,
            },
            {
                "method": "DELETE",
                "path": "/items/1",
                "fence": 1,
                "status": "outcome_unknown",
                "reject_code": None,
                "attempt": 1,
            },
        ]
        # The tool was told which receipts these were.
        assert [r["id"] for r in receipts] == [
            rec.headers.get("X-Receipt-Id") for rec in upstream.requests
        ]
