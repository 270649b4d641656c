"""`GATEWAY_MAX_INFLIGHT` through the real gateway process (docs/contract.md §11): beyond the
limit a call is answered `503 overloaded` with `Retry-After: 1` before anything is admitted or
forwarded, and leaves no receipt; `/_gateway/` paths are not counted."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.harness import (
    Behavior,
    GatewayFactory,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    make_policy,
    problem,
)


async def test_a_call_beyond_a_fixed_limit_is_shed_before_anything_happens(
    gateway_factory: GatewayFactory, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    gate = asyncio.Event()
    upstream.script("/api/slow", Behavior(gate=gate))
    gateway = await gateway_factory(
        make_policy(upstream.url, [{"match": "job/*"}]),
        extra_env={"GATEWAY_MAX_INFLIGHT": "1"},
    )
    held = asyncio.create_task(
        call(session, "POST", f"{gateway.url}/tool/slow", headers=fenced_headers("job/a", 1))
    )
    await upstream.wait_received(1)

    shed = await call(
        session,
        "POST",
        f"{gateway.url}/tool/act",
        headers=fenced_headers("job/b", 7, **{"X-Request-Id": "shed-1"}),
        data=b'{"n": 1}',
    )
    assert shed.status == 503
    body = problem(shed)
    assert body["code"] == "overloaded"
    assert body["type"] == "urn:fence-gateway:overloaded"
    assert body["request_id"] == "shed-1"
    assert shed.headers is not None and shed.headers["Retry-After"] == "1"
    plain = await call(session, "GET", f"{gateway.url}/tool/read")
    assert plain.status == 503 and problem(plain)["code"] == "overloaded"

    # /_gateway/ is not counted: the operator can still look while the process is full
    health = await call(session, "GET", f"{gateway.url}/_gateway/v1/receipts?resource=job/b")
    assert health.status == 200

    gate.set()
    assert (await held).status == 200
    assert [r.path for r in upstream.received()] == ["/api/slow"]  # the shed calls never left
    assert await fetch_receipts(session, gateway.url, resource="job/b") == []

    after = await call(
        session, "POST", f"{gateway.url}/tool/act", headers=fenced_headers("job/b", 7)
    )
    assert after.status == 200  # the slot is free again
    text = (await call(session, "GET", f"{gateway.url}/_gateway/metrics")).body.decode()
    assert 'fence_gateway_rejections_total{code="overloaded",upstream="-"} 2.0' in text


async def test_the_adaptive_limit_lets_an_ordinary_load_through(
    gateway_factory: GatewayFactory, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    """`auto` is the default; 64 calls at once are well within what it starts from."""
    gateway = await gateway_factory(make_policy(upstream.url, [{"match": "job/*"}]))
    results = await asyncio.gather(
        *(
            call(
                session,
                "POST",
                f"{gateway.url}/tool/act",
                headers=fenced_headers(f"job/{i % 8}", 1),
                data=b'{"n": %d}' % i,
            )
            for i in range(64)
        )
    )
    assert [r.status for r in results] == [200] * 64


async def test_an_mcp_client_is_shed_in_json_rpc(
    gateway_factory: GatewayFactory, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    """An MCP client reads JSON-RPC, not problem+json (docs/contract.md §16): a shed POST is a
    JSON-RPC error too, with id null since its body was never read."""
    gate = asyncio.Event()
    upstream.script("/api/mcp", Behavior(gate=gate))
    gateway = await gateway_factory(
        make_policy(upstream.url, [{"match": "mail/*", "tools": ["send_*"]}], mcp=True),
        extra_env={"GATEWAY_MAX_INFLIGHT": "1"},
    )
    listing = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}'
    json_headers = {"Content-Type": "application/json"}
    held = asyncio.create_task(
        call(session, "POST", f"{gateway.url}/tool/mcp", headers=json_headers, data=listing)
    )
    await upstream.wait_received(1)
    shed = await call(
        session, "POST", f"{gateway.url}/tool/mcp", headers=json_headers, data=listing
    )
    assert shed.status == 503
    assert shed.headers is not None and shed.headers["Retry-After"] == "1"
    assert shed.headers["Content-Type"].startswith("application/json")
    answer = json.loads(shed.body)
    assert answer["id"] is None and answer["error"]["code"] == -31050
    assert answer["error"]["data"]["code"] == "overloaded"
    gate.set()
    assert (await held).status == 200
    assert [r.path for r in upstream.received()] == ["/api/mcp"]
