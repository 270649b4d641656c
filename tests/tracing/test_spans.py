"""Spans of proxied HTTP calls (docs/contract.md §21), read off the wire: a gateway process
with `GATEWAY_OTEL=true` exports to a real OTLP/HTTP receiver in the test, and a recording
upstream shows the `traceparent` the tool received.

One gateway serves the whole story (starting one takes a while): an admitted call continuing
the client's trace, its replay, a stale fence refused, an unfenced call, a call the client
did not sample, a call without any trace, a WebSocket session, and one shed by the overload
limit."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.harness import Behavior, GatewayFactory, GatewayProcess, fenced_headers, make_policy
from tests.sessions.ws_upstream import WsUpstream
from tests.tracing.otlp import CLIENT, SERVER, OtlpReceiver, ReceivedSpan, tracing_env

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SECRET = "s3cret-tool-credential"


def traceparent(trace_id: str = TRACE, span_id: str = CALLER_SPAN, flags: str = "01") -> str:
    return f"00-{trace_id}-{span_id}-{flags}"


@pytest.fixture
async def otlp() -> AsyncIterator[OtlpReceiver]:
    async with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture
async def upstream() -> AsyncIterator[WsUpstream]:
    """The tool: it records HTTP calls and takes WebSocket sessions (docs/contract.md §15)."""
    async with WsUpstream() as server:
        yield server


@pytest.fixture
async def traced_gateway(
    gateway_factory: GatewayFactory, upstream: WsUpstream, otlp: OtlpReceiver
) -> GatewayProcess:
    policy = make_policy(
        upstream.url,
        [{"match": "orders/*"}],
        inject_headers={"Authorization": f"Bearer {SECRET}"},
        websocket=True,
    )
    env = {**tracing_env(otlp), "GATEWAY_LOG_FORMAT": "json", "GATEWAY_MAX_INFLIGHT": "1"}
    return await gateway_factory(policy, extra_env=env)


async def receipt(session: aiohttp.ClientSession, gateway: GatewayProcess, rid: str) -> Any:
    async with session.get(f"{gateway.url}/_gateway/v1/receipts/{rid}") as resp:
        assert resp.status == 200
        return await resp.json()


def server_span(otlp: OtlpReceiver, receipt_id: str) -> ReceivedSpan:
    [span] = [
        s
        for s in otlp.of_kind(SERVER)
        if s.attributes.get("fence_gateway.receipt_id") == receipt_id
    ]
    return span


async def test_spans_of_admitted_replayed_rejected_unfenced_and_shed_calls(
    traced_gateway: GatewayProcess,
    upstream: WsUpstream,
    otlp: OtlpReceiver,
    session: aiohttp.ClientSession,
) -> None:
    gateway = traced_gateway
    url = f"{gateway.url}/tool/orders/42?x=1"
    sent = {**fenced_headers("orders/a", 5), "traceparent": traceparent()}

    # admitted: the server span continues the caller's trace, the tool's parent is the client span
    async with session.post(url, data=b"{}", headers=sent) as resp:
        assert resp.status == 200
        admitted_id = resp.headers["X-Receipt-Id"]
    await otlp.wait_spans(CLIENT, 1)
    await otlp.wait_spans(SERVER, 1)
    served = server_span(otlp, admitted_id)
    [client] = otlp.of_kind(CLIENT)
    assert (served.name, served.trace_id, served.parent_span_id) == (
        "POST /tool",
        TRACE,
        CALLER_SPAN,
    )
    assert served.service == "gateway-under-test"
    assert served.attributes == {
        "http.request.method": "POST",
        "http.route": "/tool",
        "url.scheme": "http",
        "http.response.status_code": 200,
        "fence_gateway.decision": "admitted",
        "fence_gateway.resource": "orders/a",
        "fence_gateway.fence": 5,
        "fence_gateway.receipt_id": admitted_id,
        "fence_gateway.outcome": "succeeded",
    }
    assert (client.name, client.trace_id, client.parent_span_id) == (
        "POST tool",
        TRACE,
        served.span_id,
    )
    assert client.attributes["http.response.status_code"] == 200
    [forwarded] = upstream.received(method="POST")
    assert forwarded.headers["traceparent"] == traceparent(span_id=client.span_id)
    assert (await receipt(session, gateway, admitted_id))["trace_id"] == TRACE

    # the same call again: replayed, no call to the tool and no client span
    async with session.post(url, data=b"{}", headers=sent) as resp:
        assert resp.headers["Idempotent-Replayed"] == "true"
    # a stale fence: refused, with a rejected receipt that carries the trace
    stale = {**fenced_headers("orders/a", 4), "traceparent": traceparent()}
    async with session.post(url, data=b"{}", headers=stale) as resp:
        assert resp.status == 409
        rejected_id = resp.headers["X-Receipt-Id"]
    # unfenced: a GET passes without admission, its traceparent replaced all the same
    async with session.get(url, headers={"traceparent": traceparent()}) as resp:
        assert resp.status == 200
    await otlp.wait_spans(SERVER, 4)
    await otlp.wait_spans(CLIENT, 2)
    replayed, refused, unfenced = otlp.of_kind(SERVER)[1:4]
    assert {k: v for k, v in replayed.attributes.items() if k.startswith("fence_gateway.")} == {
        "fence_gateway.decision": "replayed",
        "fence_gateway.resource": "orders/a",
        "fence_gateway.fence": 5,
        "fence_gateway.receipt_id": admitted_id,
    }
    assert refused == server_span(otlp, rejected_id)
    assert {k: v for k, v in refused.attributes.items() if k != "url.scheme"} == {
        "http.request.method": "POST",
        "http.route": "/tool",
        "http.response.status_code": 409,
        "fence_gateway.decision": "rejected",
        "fence_gateway.resource": "orders/a",
        "fence_gateway.fence": 4,
        "fence_gateway.receipt_id": rejected_id,
        "fence_gateway.outcome": "rejected",
        "error.type": "stale_fence",
    }
    assert (await receipt(session, gateway, rejected_id))["trace_id"] == TRACE
    assert (
        unfenced.name == "GET /tool" and unfenced.attributes["fence_gateway.decision"] == "unfenced"
    )
    assert "fence_gateway.fence" not in unfenced.attributes
    unfenced_client = otlp.of_kind(CLIENT)[1]
    assert unfenced_client.parent_span_id == unfenced.span_id
    assert upstream.received(method="GET")[0].headers["traceparent"] == traceparent(
        span_id=unfenced_client.span_id
    )
    # never a key or an injected credential, anywhere in a span
    assert SECRET not in json.dumps([s.attributes for s in otlp.spans])

    # not sampled by the caller: no span exported, no trace id kept, the flag passed on
    spans_before = len(otlp.spans)
    unsampled = {**fenced_headers("orders/b", 1), "traceparent": traceparent(flags="00")}
    async with session.post(url, data=b"1", headers=unsampled) as resp:
        unsampled_id = resp.headers["X-Receipt-Id"]
    assert (await receipt(session, gateway, unsampled_id))["trace_id"] is None
    tool_saw = upstream.received(method="POST")[-1].headers["traceparent"]
    assert tool_saw.startswith(f"00-{TRACE}-") and tool_saw.endswith("-00")

    # no trace at all: the gateway starts one, and the receipt names it
    async with session.post(url, data=b"2", headers=fenced_headers("orders/c", 1)) as resp:
        rooted_id = resp.headers["X-Receipt-Id"]
    await otlp.wait_spans(SERVER, 5)
    rooted = server_span(otlp, rooted_id)
    assert rooted.parent_span_id == "" and rooted.trace_id != TRACE
    assert (await receipt(session, gateway, rooted_id))["trace_id"] == rooted.trace_id
    assert len(otlp.spans) == spans_before + 2  # the rooted call's server and client spans

    # a session: its upgrade is the client span, the tool's handshake carries its traceparent
    ws = await session.ws_connect(
        f"{gateway.url}/tool/ws",
        headers={**fenced_headers("orders/s", 1), "traceparent": traceparent()},
    )
    await upstream.wait_connections(1)
    await ws.close()
    await otlp.wait_spans(SERVER, 6)
    [opened] = [s for s in otlp.of_kind(SERVER) if s.attributes.get("fence_gateway.fence") == 1
                and s.attributes.get("fence_gateway.resource") == "orders/s"]  # fmt: skip
    [handshake] = [s for s in otlp.of_kind(CLIENT) if s.parent_span_id == opened.span_id]
    assert (opened.name, opened.trace_id, handshake.name) == ("GET /tool", TRACE, "GET tool")
    assert opened.attributes["fence_gateway.decision"] == "admitted"
    assert handshake.attributes["http.response.status_code"] == 101
    assert upstream.connections[0].headers["traceparent"] == traceparent(span_id=handshake.span_id)

    # shed: GATEWAY_MAX_INFLIGHT=1 and one call held at the tool
    gate = asyncio.Event()
    upstream.script("/api/slow", Behavior(gate=gate))
    held = asyncio.create_task(session.get(f"{gateway.url}/tool/slow"))
    await upstream.wait_received(1, path="/api/slow")
    async with session.get(url, headers={"traceparent": traceparent()}) as resp:
        assert resp.status == 503
    gate.set()
    (await held).release()
    await otlp.wait_spans(SERVER, 8)
    [shed] = [s for s in otlp.of_kind(SERVER) if s.attributes["fence_gateway.decision"] == "shed"]
    assert (shed.name, shed.trace_id, shed.parent_span_id) == ("GET /tool", TRACE, CALLER_SPAN)
    assert shed.attributes["error.type"] == "overloaded" and shed.status_code == 2

    # the log lines carry the trace id of the calls that were sampled
    await gateway.terminate()
    lines = [json.loads(line) for line in gateway.stderr_path.read_text().splitlines() if line]
    by_receipt = {line.get("receipt_id"): line for line in lines if line.get("event")}
    assert by_receipt[admitted_id]["trace_id"] == TRACE
    assert by_receipt[rejected_id]["trace_id"] == TRACE
    assert by_receipt[rooted_id]["trace_id"] == rooted.trace_id
    assert by_receipt[unsampled_id]["trace_id"] is None
