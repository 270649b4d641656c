"""Observability at its edges (docs/contract.md §10, §21): a text log line no client can
forge, W3C trace context read as the standard reads it (every `tracestate` line, a repeated
`traceparent` refused, no stale `tracestate` beside a new trace), every `outcome_unknown`
counted, the cleanup alert's first failure seen, a session's span with its outcome."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.observe import logs
from gateway.observe.metrics import Metrics
from tests.harness import AppFactory, RecordingUpstream, fenced_headers, make_policy

ROOT = Path(__file__).resolve().parents[1]
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def _call_lines(caplog: Any) -> list[str]:
    """The gateway's per-call log lines as the default (text) format writes them."""
    formatter = logs.TextFormatter()
    return [
        formatter.format(r)
        for r in caplog.records
        if r.name == "fence_gateway" and r.getMessage() in ("call", "rejected", "replayed")
    ]


async def test_text_log_line_cannot_be_forged_by_a_percent_encoded_path(
    make_app: AppFactory, upstream: RecordingUpstream, caplog: Any
) -> None:
    """GATEWAY_LOG_FORMAT=text is the default: a client's `%0A` in the path must not start a
    line of its own (a forged log record), nor its `%20` add fields of its own."""
    gw = await make_app(make_policy(upstream.url, [{"match": "orders/*"}]))
    forged = "/tool/x%0A12:00:00%20WARNING%20rejected%20code=stale_fence%20status=409"
    with caplog.at_level(logging.INFO, logger="fence_gateway"):
        status, _, _ = await gw.send("GET", forged)
        assert status == 200  # proxied: the path is the tool's
    lines = _call_lines(caplog)
    assert len(lines) == 1
    [line] = lines
    assert "\n" not in line, line
    keys = [m.group(1) for m in re.finditer(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)', line)]
    assert keys.count("status") == 1 and "code" not in keys, line  # none forged


# -- tracing: W3C trace context from the request's headers ----------------------------------


async def _traced(make_app: AppFactory, upstream: RecordingUpstream, monkeypatch: Any) -> Any:
    pytest.importorskip("opentelemetry.sdk")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    return await make_app(make_policy(upstream.url, [{"match": "orders/*"}]), otel=True)


async def test_tracestate_sent_in_two_header_lines_reaches_the_tool_whole(
    make_app: AppFactory, upstream: RecordingUpstream, monkeypatch: Any
) -> None:
    """W3C Trace Context §3.3: several tracestate header lines are one list (RFC 9110 §5.3),
    combined and passed on: the vendor entries of the second line reach the tool too."""
    gw = await _traced(make_app, upstream, monkeypatch)
    sent = [
        *fenced_headers("orders/a", 5).items(),
        ("traceparent", f"00-{TRACE}-{CALLER_SPAN}-01"),
        ("tracestate", "foo=1"),
        ("tracestate", "bar=2"),
    ]
    from multidict import CIMultiDict

    status, _, _ = await gw.send("POST", "/tool/orders/1", data=b"{}", headers=CIMultiDict(sent))
    assert status == 200
    [forwarded] = upstream.received(method="POST")
    assert forwarded.headers["traceparent"].split("-")[1] == TRACE
    entries = {
        item.strip() for line in forwarded.headers.getall("tracestate") for item in line.split(",")
    }
    assert entries == {"foo=1", "bar=2"}


async def test_a_duplicated_traceparent_is_not_continued(
    make_app: AppFactory, upstream: RecordingUpstream, monkeypatch: Any
) -> None:
    """W3C Trace Context test suite, test_traceparent_duplicated: two traceparent headers
    are invalid and the trace restarts; neither is continued."""
    gw = await _traced(make_app, upstream, monkeypatch)
    other = "0af7651916cd43dd8448eb211c80319c"
    from multidict import CIMultiDict

    sent = CIMultiDict(
        [
            *fenced_headers("orders/a", 5).items(),
            ("traceparent", f"00-{TRACE}-{CALLER_SPAN}-01"),
            ("traceparent", f"00-{other}-b7ad6b7169203331-01"),
        ]
    )
    status, _, _ = await gw.send("POST", "/tool/orders/1", data=b"{}", headers=sent)
    assert status == 200
    [forwarded] = upstream.received(method="POST")
    [parent] = forwarded.headers.getall("traceparent")
    assert parent.split("-")[1] not in (TRACE, other), parent


async def test_tracestate_of_a_refused_traceparent_is_not_passed_with_the_new_trace(
    make_app: AppFactory, upstream: RecordingUpstream, monkeypatch: Any
) -> None:
    """An invalid traceparent (upper-case hex: W3C allows lowercase only) starts a new trace;
    its tracestate belongs to the trace that was not continued (W3C: a vendor that fails to
    parse traceparent does not use tracestate), so the tool never gets it beside the
    gateway's new traceparent: two headers that would describe different traces."""
    gw = await _traced(make_app, upstream, monkeypatch)
    sent = {
        **fenced_headers("orders/a", 5),
        "traceparent": f"00-{TRACE.upper()}-{CALLER_SPAN.upper()}-01",
        "tracestate": "congo=t61rcWkgMzE",
    }
    status, _, _ = await gw.send("POST", "/tool/orders/1", data=b"{}", headers=sent)
    assert status == 200
    [forwarded] = upstream.received(method="POST")
    assert forwarded.headers["traceparent"].split("-")[1] != TRACE.lower()  # a new trace
    assert "tracestate" not in forwarded.headers, forwarded.headers.getall("tracestate")


# -- metrics: fence_gateway_outcome_unknown_total -------------------------------------------


async def test_an_mcp_tool_call_whose_outcome_is_lost_counts_in_outcome_unknown_total(
    make_app: AppFactory, upstream: RecordingUpstream
) -> None:
    """A fenced MCP tool call answered 200 with no JSON-RPC answer to it is recorded
    `outcome_unknown` (docs/contract.md §16), and fence_gateway_outcome_unknown_total{upstream}
    ("Calls whose outcome was lost", §10) counts it, as it counts a failure before the
    answer's head."""
    from tests.harness import Behavior

    upstream.default = Behavior(body=b'{"ok": true}')  # 2xx, but no JSON-RPC response
    policy = make_policy(
        upstream.url, [{"match": "mail/*", "tools": ["send_*"]}], name="mail", mount="/mail",
        mcp=True,
    )  # fmt: skip
    gw = await make_app(policy)
    body = (
        b'{"jsonrpc":"2.0","id":7,"method":"tools/call",'
        b'"params":{"name":"send_email","arguments":{"to":"bob"}}}'
    )
    headers = {**fenced_headers("mail/a", 3), "Content-Type": "application/json"}
    async with gw.client.post("/mail/mcp", data=body, headers=headers) as resp:
        receipt_id = resp.headers["X-Receipt-Id"]
        await resp.read()
    assert (await gw.receipt(receipt_id))["status"] == "outcome_unknown"
    assert gw.metric("fence_gateway_outcome_unknown_total", upstream="mail") == 1


# -- alert rules against what the gateway exports -------------------------------------------


def _exported_at_start(metric: str, **labels: str) -> bool:
    return Metrics().registry.get_sample_value(metric, labels) is not None


@pytest.mark.parametrize("result", ["failed", "unknown"])
def test_the_first_failed_cleanup_of_a_replica_fires_cleanup_not_reclaimed(
    tmp_path: Path, result: str
) -> None:
    """FenceGatewayCleanupNotReclaimed is `increase(...{result=~"failed|unknown"}[15m]) > 0`.
    increase() needs a sample before the rise: a series that first appears at 1 has increase
    0, so a replica's first failed or unknown cleanup alerts only because the gateway exports
    fence_gateway_sweeper_cleanups_total{result} from 0 at start. The series here is what a
    scrape of the gateway sees: 0 when it is exported from the start (absent if it were not,
    and then the alert does not fire), then 1."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool is missing")
    metric = "fence_gateway_sweeper_cleanups_total"
    before = "0x10" if _exported_at_start(metric, result=result) else "_x10"
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())
    for rule in rules["groups"][0]["rules"]:
        rule.pop("annotations", None)  # only whether it fires is tested here
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump(rules))
    (tmp_path / "t.yaml").write_text(
        f"""rule_files: [alerts.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: '{metric}{{instance="gw-1",result="{result}"}}'
        values: '{before} 1x20'
    alert_rule_test:
      - eval_time: 13m
        alertname: FenceGatewayCleanupNotReclaimed
        exp_alerts:
          - exp_labels: {{severity: warning}}
"""
    )
    run = subprocess.run(
        ["promtool", "test", "rules", "t.yaml"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


# -- tracing: the server span's attributes --------------------------------------------------


async def test_a_sessions_server_span_carries_its_receipts_outcome(
    make_app: AppFactory, monkeypatch: Any
) -> None:
    """docs/contract.md §21: `fence_gateway.outcome` is the receipt's status, the outcome of
    an admitted call, on a fenced WebSocket session's server span too (`succeeded`), not
    only on a forwarded call's."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from gateway.proxy import appkeys
    from tests.sessions.ws_upstream import WsUpstream

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    async with WsUpstream() as tool:
        policy = make_policy(tool.url, [{"match": "orders/*"}], websocket=True)
        gw = await make_app(policy, otel=True)
        # as `serve` runs it (handler_cancellation=False); aiohttp's test server cancels
        gw.server.runner.server.handler_cancellation = False
        exported = InMemorySpanExporter()
        gw.app[appkeys.TRACING].provider.add_span_processor(SimpleSpanProcessor(exported))
        ws = await gw.client.ws_connect(
            "/tool/ws",
            headers={
                **fenced_headers("orders/s", 1),
                "traceparent": f"00-{TRACE}-{CALLER_SPAN}-01",
            },
        )
        receipt_id = ws._response.headers["X-Receipt-Id"]
        await tool.wait_connections(1)
        await ws.close()
        for _ in range(100):
            served = [s for s in exported.get_finished_spans() if s.kind == SpanKind.SERVER]
            if served:
                break
            await asyncio.sleep(0.05)
        [span] = served
        receipt = await gw.receipt(receipt_id)
    assert receipt["status"] == "succeeded"
    assert span.attributes["fence_gateway.decision"] == "admitted"
    assert span.attributes.get("fence_gateway.outcome") == "succeeded", dict(span.attributes)
