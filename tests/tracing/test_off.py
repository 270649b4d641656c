"""Tracing off, and tracing asked for without what it needs (docs/contract.md §21): without
`GATEWAY_OTEL` the gateway process never imports an opentelemetry module (though the package
is installed: the MCP SDK brings its API), leaves `traceparent` to the client and keeps no
trace id; `GATEWAY_OTEL=true` without the otel extra, or with an exporter that is not
installed, stops the start with one line and exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.harness import (
    REPO_ROOT,
    GatewayFactory,
    RecordingUpstream,
    fenced_headers,
    make_policy,
    write_policy,
)

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_without_gateway_otel_no_opentelemetry_module_is_imported(
    gateway_factory: GatewayFactory, upstream: RecordingUpstream, session: aiohttp.ClientSession
) -> None:
    # every import the process makes is written to its stderr, at start and on each call
    gateway = await gateway_factory(
        make_policy(upstream.url, [{"match": "orders/*"}]),
        extra_env={"PYTHONPROFILEIMPORTTIME": "1"},
    )
    url = f"{gateway.url}/tool/orders/1"
    headers = {**fenced_headers("orders/a", 3), "traceparent": PARENT}
    async with session.post(url, data=b"{}", headers=headers) as resp:
        assert resp.status == 200
        receipt_id = resp.headers["X-Receipt-Id"]
    async with session.get(url, headers={"traceparent": PARENT}) as resp:
        assert resp.status == 200
    async with session.get(f"{gateway.url}/_gateway/v1/receipts/{receipt_id}") as resp:
        assert (await resp.json())["trace_id"] is None
    assert [r.headers["traceparent"] for r in upstream.requests] == [PARENT, PARENT]
    await gateway.terminate()
    imports = gateway.stderr_path.read_text()
    assert "import time:" in imports and "aiohttp" in imports  # the profile did run
    assert "opentelemetry" not in imports


def serve(
    tmp_path: Path, env: dict[str, str], prelude: str = ""
) -> subprocess.CompletedProcess[str]:
    """`fence-gateway serve` as `python -c` (`prelude` first), with only `env` configuring it."""
    policy = write_policy(tmp_path / "p.yaml", make_policy("http://127.0.0.1:9", []))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OTEL_"))}
    clean.update(
        PYTHONPATH=str(REPO_ROOT),
        GATEWAY_POLICIES=str(policy),
        GATEWAY_DATABASE_URL=f"sqlite:///{tmp_path / 'gw.db'}",
        GATEWAY_PORT="0",
        **env,
    )
    code = f"{prelude}\nimport sys\nfrom gateway.cli.main import main\nsys.exit(main(['serve']))"
    return subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=60
    )


def test_gateway_otel_without_the_extra_stops_the_start_with_one_line(tmp_path: Path) -> None:
    # as if the otel extra were not installed: every opentelemetry import fails
    result = serve(
        tmp_path, {"GATEWAY_OTEL": "true"}, "import sys; sys.modules['opentelemetry'] = None"
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "fence-gateway: GATEWAY_OTEL=true needs the otel extra "
        "(pip install 'fence-gateway[otel]'): opentelemetry is not installed"
    ]


def test_an_exporter_that_is_not_installed_stops_the_start(tmp_path: Path) -> None:
    result = serve(tmp_path, {"GATEWAY_OTEL": "true", "OTEL_TRACES_EXPORTER": "zipkin"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "fence-gateway: OTEL_TRACES_EXPORTER: no span exporter 'zipkin' is installed "
        "(the otel extra brings otlp and console)"
    ]
