"""Running the gateway: shutdown, start-up refusals, the HTTP edges, and what operators read.

docs/contract.md §9 (SIGTERM drains calls in flight and exits 0; a second process on one
SQLite file refuses to start), §10 (healthz, readyz, metrics, JSON logs, the open-bind
refusal), §5 (oversized heads, parser refusals, the head and body timeouts) and §7 (bad
receipt-list parameters are `400 invalid_request`). The gateway runs as a subprocess, except
in the last classes, which run it in process (`make_app`) to read its metrics registry or its
log, or to start it on a store written beforehand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.server.overload import LIMIT
from gateway.store.sqlite import SqliteStore
from tests.harness import (
    AppFactory,
    Behavior,
    GatewayFactory,
    GatewayProcess,
    GatewayStartError,
    InProcessGateway,
    RecordingUpstream,
    build_raw,
    call,
    chunked,
    fenced_headers,
    fetch_receipts,
    make_policy,
    pick,
    problem,
    raw_request,
    write_policy,
)
from tests.store.test_contract import call as store_call
from tests.store.test_sqlite import commit_threads

RESOURCE = "ops/r1"


def policy(upstream: RecordingUpstream, **options: Any) -> dict[str, Any]:
    return make_policy(upstream.url, [{"match": "ops/**"}], **options)


Launcher = Callable[..., GatewayProcess]


@pytest.fixture
async def launcher(tmp_path: Path) -> AsyncIterator[Launcher]:
    """Gateway processes built but not started: the test starts them (some must fail)."""
    made: list[GatewayProcess] = []

    def make(policy_doc: Mapping[str, Any], extra_env: Mapping[str, str]) -> GatewayProcess:
        workdir = tmp_path / f"launch{len(made)}"
        workdir.mkdir()
        path = write_policy(workdir / "policies.yaml", policy_doc)
        gateway = GatewayProcess(workdir, path, extra_env=extra_env, ready_timeout=10)
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        gateway.kill9_sync()


async def start_fails(gateway: GatewayProcess) -> tuple[int | None, list[str]]:
    """(exit status, stderr lines) of a start that must not succeed."""
    with pytest.raises(GatewayStartError):
        await gateway.start()
    lines = gateway.stderr_path.read_text(errors="replace").splitlines()
    return gateway.returncode, lines


def reason_lines(lines: list[str]) -> list[str]:
    """The CLI's own one-line reasons (log lines written before them are not reasons)."""
    return [line for line in lines if line.startswith("fence-gateway:")]


async def refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except (ConnectionRefusedError, ConnectionResetError):
        # A listener closing while the connection sits in its backlog resets it: refused too.
        return True
    writer.close()
    return False


# --------------------------------------------------------------------------------------------
# Shutdown and start-up
# --------------------------------------------------------------------------------------------


class TestLifecycle:
    async def test_sigterm_lets_the_call_in_flight_finish_and_exits_0(
        self, upstream, gateway_factory: GatewayFactory, session
    ) -> None:
        # The tool takes a second, and answers only once the test has seen new connections
        # refused: the call is certainly in flight through the whole shutdown.
        release = asyncio.Event()
        upstream.default = Behavior(
            gate=release,
            delay=1.0,
            body=b'{"done": true}',
            headers={"Content-Type": "application/json"},
        )
        gateway = await gateway_factory(
            policy(upstream), extra_env={"GATEWAY_SHUTDOWN_GRACE_S": "5"}
        )
        assert gateway.proc is not None and gateway.port is not None
        in_flight = asyncio.create_task(
            call(
                session,
                "POST",
                f"{gateway.url}/tool/deploy",
                data=b"{}",
                headers=fenced_headers(RESOURCE, 1),
            )
        )
        await upstream.wait_received(1)
        gateway.proc.send_signal(signal.SIGTERM)

        deadline = time.monotonic() + 3
        while not await refused(gateway.port):
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            await asyncio.sleep(0.02)
        assert not in_flight.done() and gateway.returncode is None
        release.set()

        result = await in_flight
        assert (result.status, result.body) == (200, b'{"done": true}')
        assert await gateway.terminate(timeout=10) == 0

        await gateway.restart()
        receipts = await fetch_receipts(session, gateway.url, resource=RESOURCE)
        assert [pick(r, ("id", "status", "http_status")) for r in receipts] == [
            {"id": result.headers["X-Receipt-Id"], "status": "succeeded", "http_status": 200}
        ]
        assert "Traceback" not in gateway.stderr_text()

    async def test_a_second_process_on_the_same_sqlite_file_exits_2(
        self, upstream, gateway_factory: GatewayFactory, launcher: Launcher, session
    ) -> None:
        first = await gateway_factory(policy(upstream))
        second = launcher(policy(upstream), {"GATEWAY_DATABASE_URL": f"sqlite:///{first.db_path}"})
        code, lines = await start_fails(second)
        assert code == 2
        assert "Traceback" not in "\n".join(lines)
        reasons = reason_lines(lines)
        assert len(reasons) == 1 and lines[-1] == reasons[0], lines
        assert str(first.db_path) in reasons[0]
        ready = await call(session, "GET", f"{first.url}/_gateway/readyz")
        assert ready.status == 200, "the first gateway is undisturbed"

    async def test_open_gateway_on_a_public_address_needs_allow_open(
        self, upstream, launcher: Launcher, session
    ) -> None:
        refused_start = launcher(policy(upstream), {"GATEWAY_HOST": "0.0.0.0"})
        code, lines = await start_fails(refused_start)
        assert code == 2
        reasons = reason_lines(lines)
        assert len(reasons) == 1 and "GATEWAY_CLIENTS" in reasons[0], lines

        allowed = launcher(
            policy(upstream), {"GATEWAY_HOST": "0.0.0.0", "GATEWAY_ALLOW_OPEN": "true"}
        )
        await allowed.start()
        ready = await call(session, "GET", f"{allowed.url}/_gateway/readyz")
        assert ready.status == 200


# --------------------------------------------------------------------------------------------
# HTTP edges
# --------------------------------------------------------------------------------------------


@pytest.mark.both_parsers
class TestHttpEdges:
    @pytest.fixture
    async def gateway(self, upstream, gateway_factory: GatewayFactory) -> GatewayProcess:
        return await gateway_factory(
            policy(upstream), extra_env={"GATEWAY_HEADER_TIMEOUT_S": "0.5"}
        )

    async def closed_after(self, gateway: GatewayProcess, trickle: bool) -> float:
        """Seconds until the gateway closes a connection whose head never completes."""
        assert gateway.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        started = time.monotonic()
        writer.write(b"GET /tool/x HTTP/1.1\r\nHost: 127.0.0.1\r\n")

        async def feed() -> None:
            # One more header byte every 0.1 s: bytes alone never extend the deadline.
            for _ in range(50):
                await asyncio.sleep(0.1)
                writer.write(b"X")
                await writer.drain()

        feeder = asyncio.create_task(feed()) if trickle else None
        try:
            with contextlib.suppress(ConnectionResetError):
                await asyncio.wait_for(reader.read(), timeout=4)
            return time.monotonic() - started
        finally:
            if feeder is not None:
                feeder.cancel()
                await asyncio.gather(feeder, return_exceptions=True)
            writer.close()

    async def test_an_incomplete_head_is_closed_after_the_header_timeout(
        self, gateway, upstream
    ) -> None:
        for trickle in (False, True):
            elapsed = await self.closed_after(gateway, trickle)
            assert 0.4 <= elapsed <= 3.0, (trickle, elapsed)
        assert upstream.requests == []
        assert "Traceback" not in gateway.stderr_text()

    async def test_a_header_over_8190_bytes_is_431(self, gateway, upstream) -> None:
        assert gateway.port is not None
        payload = build_raw("GET", "/tool/x", [("X-Big", "a" * 9000)])
        response = await raw_request("127.0.0.1", gateway.port, payload)
        assert response is not None, "closed without an answer"
        assert pick(problem(response.as_call()), ("status", "code")) == {
            "status": 431,
            "code": "headers_too_large",
        }
        assert upstream.requests == []

    async def test_content_length_with_transfer_encoding_is_400_and_leaves_nothing(
        self, gateway, upstream, session
    ) -> None:
        assert gateway.port is not None
        headers = [
            *fenced_headers(RESOURCE, 1).items(),
            ("Content-Length", "5"),
            ("Transfer-Encoding", "chunked"),
        ]
        payload = build_raw("POST", "/tool/x", headers, content_length=False) + chunked(b"hello")
        response = await raw_request("127.0.0.1", gateway.port, payload)
        assert response is not None, "closed without an answer"
        assert response.status == 400
        assert upstream.requests == []
        assert await fetch_receipts(session, gateway.url) == []


# --------------------------------------------------------------------------------------------
# Operator endpoints
# --------------------------------------------------------------------------------------------

CONTRACT_FAMILIES = {
    "fence_gateway_requests_total": "counter",
    "fence_gateway_rejections_total": "counter",
    "fence_gateway_lease_acquisitions_total": "counter",
    "fence_gateway_lease_renewals_total": "counter",
    "fence_gateway_lease_held_seconds": "histogram",
    "fence_gateway_outcome_unknown_total": "counter",
    "fence_gateway_outcome_unknown_oldest_seconds": "gauge",
    "fence_gateway_reconciliations_total": "counter",
    "fence_gateway_sweeper_cleanups_total": "counter",
    "fence_gateway_admission_seconds": "histogram",
    "fence_gateway_upstream_seconds": "histogram",
}


class TestOperatorEndpoints:
    @pytest.fixture
    async def gateway(self, upstream, gateway_factory: GatewayFactory) -> GatewayProcess:
        return await gateway_factory(policy(upstream))

    async def test_healthz_readyz_and_unknown_gateway_paths(self, gateway, session) -> None:
        health = await call(session, "GET", f"{gateway.url}/_gateway/healthz")
        ready = await call(session, "GET", f"{gateway.url}/_gateway/readyz")
        assert (health.status, health.json()) == (200, {"status": "ok"})
        assert (ready.status, ready.json()["status"]) == (200, "ready")

        unknown = {}
        for method, path in (
            ("GET", "/_gateway/nope"),
            ("GET", "/_gateway/v1/nope"),
            ("POST", "/_gateway/v1/things/1"),
            ("GET", "/_gateway/"),
        ):
            result = await call(session, method, f"{gateway.url}{path}")
            unknown[method, path] = pick(problem(result), ("status", "code"))
        assert unknown == {
            key: {"status": 404, "code": "not_found"}
            for key in (
                ("GET", "/_gateway/nope"),
                ("GET", "/_gateway/v1/nope"),
                ("POST", "/_gateway/v1/things/1"),
                ("GET", "/_gateway/"),
            )
        }

    async def test_metrics_count_by_upstream_and_result_without_resource_keys(
        self, gateway, upstream, session
    ) -> None:
        secret_resource = "ops/secret-account-42"
        url = f"{gateway.url}/tool/act"
        admitted = await call(
            session, "POST", url, data=b"{}", headers=fenced_headers(secret_resource, 5)
        )
        stale = await call(
            session, "POST", url, data=b"{}", headers=fenced_headers(secret_resource, 3)
        )
        plain = await call(session, "GET", url)
        assert (admitted.status, stale.status, plain.status) == (200, 409, 200)

        metrics = await call(session, "GET", f"{gateway.url}/_gateway/metrics")
        assert metrics.status == 200
        text = metrics.body.decode()
        types = {
            line.split()[2]: line.split()[3]
            for line in text.splitlines()
            if line.startswith("# TYPE")
        }
        assert {name: types.get(name) for name in CONTRACT_FAMILIES} == CONTRACT_FAMILIES

        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

        def values(name: str, *labels: str) -> dict[tuple[str, ...], float]:
            return {
                tuple(s.labels[label] for label in labels): s.value
                for s in samples
                if s.name == name
            }

        assert values("fence_gateway_requests_total", "upstream", "result") == {
            ("tool", "forwarded"): 2.0,
            ("tool", "rejected"): 1.0,
        }
        assert values("fence_gateway_rejections_total", "upstream", "code") == {
            ("tool", "stale_fence"): 1.0
        }
        assert values("fence_gateway_admission_seconds_count")[()] >= 1
        upstream_counts = values("fence_gateway_upstream_seconds_count", "upstream")
        assert list(upstream_counts) == [("tool",)] and upstream_counts["tool",] >= 1
        label_values = {v for s in samples for v in s.labels.values()}
        assert not any("secret-account-42" in v or "ops/" in v for v in label_values)
        assert "secret-account-42" not in text

    async def test_bad_receipt_list_parameters_are_400(self, gateway, session) -> None:
        cases = {
            "limit=0": "limit=0",
            "limit=1001": "limit=1001",
            "limit=abc": "limit=abc",
            "cursor=garbage": "cursor=garbage",
            "status=nope": "status=nope",
            "since=yesterday": "since=yesterday",
            "until=2026-13-01": "until=2026-13-01",
            "fence_min=-1": "fence_min=-1",
            "unknown": "color=red",
            "twice": "limit=1&limit=2",
        }
        answers = {}
        for name, query in cases.items():
            result = await call(session, "GET", f"{gateway.url}/_gateway/v1/receipts?{query}")
            answers[name] = pick(problem(result), ("status", "code"))
        for query in ("limit=0", "cursor=garbage", "status=pending"):
            result = await call(session, "GET", f"{gateway.url}/_gateway/v1/reconciliation?{query}")
            answers[f"reconciliation {query}"] = pick(problem(result), ("status", "code"))
        assert answers == {name: {"status": 400, "code": "invalid_request"} for name in answers}
        assert len(answers) == len(cases) + 3

        fine = await call(session, "GET", f"{gateway.url}/_gateway/v1/receipts?limit=1000")
        assert (fine.status, fine.json()) == (200, {"items": [], "next_cursor": None})


class TestJsonLogs:
    async def test_every_line_is_json_and_calls_and_rejections_carry_their_fields(
        self, upstream, gateway_factory: GatewayFactory, session
    ) -> None:
        credential = "tool-credential-Zq81"
        body_marker = "BODY-MARKER-4471"
        gateway = await gateway_factory(
            policy(upstream, inject_headers={"Authorization": "Bearer ${OPS_TOOL_TOKEN}"}),
            extra_env={"GATEWAY_LOG_FORMAT": "json", "OPS_TOOL_TOKEN": credential},
        )
        url = f"{gateway.url}/tool/orders"
        body = json.dumps({"note": body_marker}).encode()
        admitted = await call(
            session,
            "POST",
            url,
            data=body,
            headers=fenced_headers(RESOURCE, 8, **{"X-Request-Id": "req-log-1"}),
        )
        stale = await call(
            session,
            "POST",
            url,
            data=body,
            headers=fenced_headers(RESOURCE, 2, **{"X-Request-Id": "req-log-2"}),
        )
        assert (admitted.status, stale.status) == (200, 409)
        assert upstream.requests[0].headers["Authorization"] == f"Bearer {credential}"
        await gateway.terminate()

        text = gateway.stderr_path.read_text()
        entries = []
        for line in text.splitlines():
            if line.strip():
                entry = json.loads(line)  # fails loudly on a non-JSON line
                assert isinstance(entry, dict), line
                entries.append(entry)
        by_request = {e.get("request_id"): e for e in entries if e.get("request_id")}
        call_line, reject_line = by_request["req-log-1"], by_request["req-log-2"]

        required = (
            "ts",
            "level",
            "event",
            "request_id",
            "receipt_id",
            "client",
            "resource",
            "fence",
            "upstream",
            "method",
            "path",
            "status",
            "duration_ms",
        )
        for entry in (call_line, reject_line):
            assert [f for f in required if f not in entry] == [], entry
            assert isinstance(entry["ts"], str) and isinstance(entry["fence"], int)
            assert isinstance(entry["duration_ms"], int | float)
            assert entry["path"] in ("/tool/orders", "/orders")
        fields = ("receipt_id", "client", "resource", "fence", "upstream", "method", "status")
        assert pick(call_line, fields) == {
            "receipt_id": admitted.headers["X-Receipt-Id"],
            "client": None,
            "resource": RESOURCE,
            "fence": 8,
            "upstream": "tool",
            "method": "POST",
            "status": 200,
        }
        assert pick(reject_line, (*fields, "code")) == {
            "receipt_id": stale.headers["X-Receipt-Id"],
            "client": None,
            "resource": RESOURCE,
            "fence": 2,
            "upstream": "tool",
            "method": "POST",
            "status": 409,
            "code": "stale_fence",
        }
        assert credential not in text
        assert body_marker not in text


# --------------------------------------------------------------------------------------------
# In process
# --------------------------------------------------------------------------------------------


@pytest.fixture
async def gw(make_app: AppFactory, upstream: RecordingUpstream) -> InProcessGateway:
    """`shared/*` fenced externally and `run/*` leased by the gateway, with a 0.5 s body
    timeout."""
    policy = make_policy(
        upstream.url,
        [
            {"match": "shared/*"},
            {"match": "run/*", "lease": {"issuer": "gateway", "ttl_s": 0.3, "max_ttl_s": 5}},
        ],
        timeout_s=1,
    )
    return await make_app(policy, body_timeout_s=0.5, reconcile_grace_s=0)


class TestApiInputEdges:
    """§5 and §7: gateway API input the store or the parser cannot take is a problem+json
    4xx, never a 500."""

    async def test_a_receipt_list_bound_too_large_for_the_store_is_400(self, gw):
        async with gw.client.get("/_gateway/v1/receipts?fence_min=9999999999999999999") as r:
            assert (r.status, (await r.json())["code"]) == (400, "invalid_request")

    async def test_a_trickled_api_body_times_out(self, gw):
        reader, writer = await asyncio.open_connection(gw.host, gw.port)
        writer.write(
            b"POST /_gateway/v1/leases/run/d HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        )
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert status_line.split()[1] == b"408"


class TestMetricsInProcess:
    """§10: every call is counted by what the gateway did with it, refusals before routing to
    a rule and outcomes lost to a restart included."""

    async def test_refusals_before_routing_by_rule_are_counted(self, gw):
        async with gw.client.post("/tool/x", headers={"X-Fence-Token": "1"}) as r:
            assert r.status == 428
        assert (
            gw.metric("fence_gateway_rejections_total", upstream="tool", code="missing_resource")
            == 1
        )

    async def test_a_tools_own_replay_header_is_not_a_gateway_replay(self, gw, upstream):
        upstream.script("/api/pay", Behavior(headers={"Idempotent-Replayed": "true"}))
        async with gw.client.post("/tool/pay", headers=fenced_headers("shared/f", 1)) as answer:
            assert answer.status == 200
        assert gw.metric("fence_gateway_requests_total", upstream="tool", result="forwarded") == 1

    async def test_recovery_counts_lost_outcomes(self, tmp_path, upstream, make_app):
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()
        await store.admit(store_call(1))
        await store.close()
        gw = await make_app(
            make_policy(upstream.url, [{"match": "acct/*"}]), instance_id="two", sweep_interval_s=1
        )
        assert gw.metric("fence_gateway_outcome_unknown_total", upstream="tool") == 1


class TestCommitsOfACallAlone:
    """The server tells the SQLite store how many calls are at work (gateway.store.
    group_commit): the commits of a call with nothing else at work are made by the event
    loop; with one more call at work, by the writer thread."""

    async def test_a_call_alone_is_committed_by_the_loop(self, upstream, make_app):
        gw = await make_app(make_policy(upstream.url, [{"match": "shared/*"}]))
        commits = commit_threads(gw.store)
        async with gw.client.post("/tool/pay", headers=fenced_headers("shared/a", 1)) as answer:
            assert answer.status == 200
        assert commits == [threading.current_thread().name] * 2  # admission, outcome

    async def test_beside_another_call_at_work_the_writer_commits(self, upstream, make_app):
        gw = await make_app(make_policy(upstream.url, [{"match": "shared/*"}]))
        commits = commit_threads(gw.store)
        # two other calls, at their tools all along (in process, the test client's own call
        # reaches aiohttp's server, which leaves the counting to the gateway's HTTP server)
        gw.app[LIMIT].in_flight += 2
        try:
            async with gw.client.post("/tool/pay", headers=fenced_headers("shared/a", 1)) as r:
                assert r.status == 200
        finally:
            gw.app[LIMIT].in_flight -= 2
        assert len(commits) == 2 and all(t.startswith("sqlite-writer") for t in commits)


class TestStartupWarnings:
    """§10: what the store found at open that works but should not be so (a PostgreSQL server
    without autovacuum: tests/store/test_postgres.py) is a WARNING line of the server's."""

    async def test_the_stores_warnings_are_logged_at_start(
        self, upstream, make_app, monkeypatch, caplog
    ):
        found = (("store_found_this", "a detail"), ("store_found_that", "another"))
        monkeypatch.setattr(SqliteStore, "open_warnings", found)
        with caplog.at_level(logging.WARNING, logger="fence_gateway"):
            await make_app(make_policy(upstream.url, [{"match": "acct/*"}]))
        logged = [
            (r.getMessage(), r.fields["detail"])
            for r in caplog.records
            if r.getMessage().startswith("store_found_") and r.levelno == logging.WARNING
        ]
        assert logged == list(found)
