"""Reconciling lost outcomes end to end (docs/contract.md §3 "late outcomes", §7 resolve, probe,
lists).

The tool here is a small ledger on the recording upstream: it stores operations by their
Idempotency-Key and answers `GET /operations/{key}` with 200 or 404, which is what the policy's
probe asks. It can be told to drop the connection after applying an operation (the outcome is
lost, the effect is real) or before (nothing happened, the gateway cannot know).

Most tests run the gateway as a subprocess with `GATEWAY_RECONCILE_GRACE_S=0` and the `tool`
upstream's `timeout_s` at 0.5 s, so a lost outcome is reconcilable half a second after it was
forwarded; the `slow` upstream (timeout 30 s) keeps its receipts unreconcilable throughout.
The late-outcome tests run the app in process: a late outcome needs a receipt turned
`outcome_unknown` (or reconciled) while its call is still running, which one SQLite gateway
never does to its own calls; there the test plays the other replica, through the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import unquote

import aiohttp
import pytest

from gateway.core.receipts import ReconcileWaits
from tests.harness import (
    AppFactory,
    Behavior,
    CallResult,
    GatewayFactory,
    GatewayProcess,
    InProcessGateway,
    Recorded,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    make_policy,
    metric_samples,
    pick,
    problem,
)

TIMEOUT_S = 0.5
PROBE = {"method": "GET", "path": "/operations/{idempotency_key}"}
RECONCILE_ENV = {"GATEWAY_RECONCILE_GRACE_S": "0"}


def policy(upstream_url: str) -> dict[str, Any]:
    fast = make_policy(
        upstream_url,
        [{"match": "ledger/*", "probe": PROBE}, {"match": "plain/*"}, {"match": "many/*"}],
        name="tool",
        mount="/tool",
        timeout_s=TIMEOUT_S,
    )
    slow = make_policy(
        upstream_url, [{"match": "slowpoke/*", "probe": PROBE}], name="slow", mount="/slow"
    )
    slow["upstreams"][0]["timeout_s"] = 30
    return {
        "upstreams": fast["upstreams"] + slow["upstreams"],
        "resources": fast["resources"] + slow["resources"],
    }


class Ledger:
    """The tool's own record of operations, by Idempotency-Key (what the probe asks)."""

    def __init__(self, upstream: RecordingUpstream) -> None:
        self.applied: dict[str, int] = {}
        self.plans: dict[str, list[str]] = {}  # key -> next steps: apply, apply+drop, drop
        self.probe_answers: dict[str, Behavior] = {}
        upstream.default = self.handle

    def plan(self, key: str, *steps: str) -> None:
        self.plans[key] = list(steps)

    def handle(self, rec: Recorded) -> Behavior:
        if rec.method == "GET" and rec.path.startswith("/api/operations/"):
            key = unquote(rec.path.removeprefix("/api/operations/"))
            if key in self.probe_answers:
                return self.probe_answers[key]
            if key in self.applied:
                return Behavior(status=200, body=json.dumps({"key": key}).encode())
            return Behavior(status=404, body=b'{"error": "no such operation"}')
        key = rec.headers["Idempotency-Key"]
        steps = self.plans.get(key) or ["apply"]
        step = steps.pop(0)
        if step != "drop":
            self.applied[key] = self.applied.get(key, 0) + 1
        if step == "apply":
            return Behavior(status=201, body=json.dumps({"key": key}).encode())
        return Behavior(action="close")


async def post(
    session: aiohttp.ClientSession,
    base_url: str,
    resource: str,
    key: str,
    *,
    mount: str = "/tool",
    body: bytes = b'{"amount": 10}',
) -> CallResult:
    headers = fenced_headers(resource, 1, **{"Idempotency-Key": key})
    return await call(session, "POST", f"{base_url}{mount}/ops", data=body, headers=headers)


async def api(
    session: aiohttp.ClientSession, base_url: str, method: str, path: str, **kwargs: Any
) -> tuple[int, Any]:
    """(status, JSON) of a gateway API call; every error must be problem+json."""
    async with session.request(method, f"{base_url}/_gateway/v1{path}", **kwargs) as resp:
        expected = "application/problem+json" if resp.status >= 400 else "application/json"
        assert resp.content_type == expected, (resp.status, resp.content_type)
        return resp.status, await resp.json(content_type=None)


async def resolve(
    session: aiohttp.ClientSession,
    gateway: GatewayProcess,
    receipt_id: str,
    outcome: str = "not_applied",
    source: str = "operator:alice",
    **extra: Any,
) -> tuple[int, Any]:
    body = {"outcome": outcome, "source": source, **extra}
    return await api(session, gateway.url, "POST", f"/receipts/{receipt_id}/resolve", json=body)


@pytest.fixture
async def ledger(upstream: RecordingUpstream) -> Ledger:
    return Ledger(upstream)


@pytest.fixture
async def gateway(
    upstream: RecordingUpstream, ledger: Ledger, gateway_factory: GatewayFactory
) -> GatewayProcess:
    return await gateway_factory(policy(upstream.url), extra_env=RECONCILE_ENV)


async def lose(
    session: aiohttp.ClientSession, gateway: GatewayProcess, ledger: Ledger, key: str, step: str
) -> str:
    """A call on ledger/r1 whose outcome is lost (`step`: apply+drop or drop); its receipt."""
    ledger.plan(key, step)
    result = await post(session, gateway.url, "ledger/r1", key)
    assert pick(problem(result), ("status", "code")) == {
        "status": 502,
        "code": "upstream_outcome_unknown",
    }
    return result.headers["X-Receipt-Id"]


async def past_grace() -> None:
    await asyncio.sleep(TIMEOUT_S + 0.1)  # forwarded_at + timeout_s + grace (0) has passed


class TestResolve:
    """An operator resolves a lost outcome; the key then answers by the resolution."""

    async def test_lost_call_is_refused_resolved_not_applied_then_retried_as_attempt_2(
        self, gateway: GatewayProcess, ledger: Ledger, upstream: RecordingUpstream, session
    ) -> None:
        receipt_id = await lose(session, gateway, ledger, "k-1", "drop")
        retry = await post(session, gateway.url, "ledger/r1", "k-1")
        _, queue = await api(session, gateway.url, "GET", "/reconciliation")
        await past_grace()
        resolved = await resolve(session, gateway, receipt_id, note="tool has no record")
        again = await resolve(session, gateway, receipt_id, outcome="applied")
        _, queue_after = await api(session, gateway.url, "GET", "/reconciliation")
        attempt_2 = await post(session, gateway.url, "ledger/r1", "k-1")

        assert pick(problem(retry), ("status", "code", "receipt_id")) == {
            "status": 409,
            "code": "outcome_unknown",
            "receipt_id": receipt_id,
        }
        assert [r["id"] for r in queue["items"]] == [receipt_id]
        status, receipt = resolved
        assert status == 200
        assert pick(receipt, ("id", "status", "attempt", "idempotency_key")) == {
            "id": receipt_id,
            "status": "reconciled",
            "attempt": 1,
            "idempotency_key": "k-1",
        }
        assert receipt["resolution"] == {
            "outcome": "not_applied",
            "source": "operator:alice",
            "note": "tool has no record",
            "at": receipt["resolution"]["at"],
        }
        assert (again[0], again[1]["code"]) == (409, "not_reconcilable")
        assert "already reconciled" in again[1]["detail"]
        assert queue_after["items"] == []
        assert attempt_2.status == 201
        receipts = await fetch_receipts(session, gateway.url, idempotency_key="k-1")
        assert [pick(r, ("status", "attempt", "reject_code")) for r in receipts] == [
            {"status": "reconciled", "attempt": 1, "reject_code": None},
            {"status": "rejected", "attempt": None, "reject_code": "outcome_unknown"},
            {"status": "succeeded", "attempt": 2, "reject_code": None},
        ]
        assert [r.headers["Idempotency-Key"] for r in upstream.received(method="POST")] == [
            "k-1",
            "k-1",
        ]
        assert ledger.applied == {"k-1": 1}
        assert await metric_samples(
            session, gateway.url, "fence_gateway_reconciliations_total"
        ) == {'outcome="not_applied",source="operator"': 1.0}

    async def test_resolve_before_grace_is_not_reconcilable(
        self, gateway: GatewayProcess, ledger: Ledger, session
    ) -> None:
        ledger.plan("k-slow", "drop")
        lost = await post(session, gateway.url, "slowpoke/r1", "k-slow", mount="/slow")
        await past_grace()  # long enough for the tool upstream, not for slow's 30 s
        status, body = await resolve(session, gateway, lost.headers["X-Receipt-Id"])

        assert lost.status == 502
        assert (status, body["code"], body["status"]) == (409, "not_reconcilable", 409)
        assert "reconcilable from" in body["detail"]
        _, receipt = await api(
            session, gateway.url, "GET", f"/receipts/{lost.headers['X-Receipt-Id']}"
        )
        assert (receipt["status"], receipt["resolution"]) == ("outcome_unknown", None)

    async def test_only_outcome_unknown_receipts_are_reconcilable(
        self, gateway: GatewayProcess, session
    ) -> None:
        done = await post(session, gateway.url, "ledger/r1", "k-done")
        await past_grace()
        status, body = await resolve(session, gateway, done.headers["X-Receipt-Id"], "applied")
        missing = await resolve(session, gateway, "01JDQ3NOSUCHRECEIPT0000000")

        assert done.status == 201
        assert (status, body["code"]) == (409, "not_reconcilable")
        assert "is succeeded" in body["detail"]
        assert (missing[0], missing[1]["code"]) == (404, "not_found")

    async def test_bad_input_is_400_and_changes_nothing(
        self, gateway: GatewayProcess, ledger: Ledger, session
    ) -> None:
        receipt_id = await lose(session, gateway, ledger, "k-bad", "drop")
        await past_grace()
        cases = {
            b"{not json": "not valid JSON",
            b'["applied"]': "JSON object",
            b"": "'outcome' is required",
            b'{"outcome": "applied"}': "'source' is required",
            b'{"source": "operator:a"}': "'outcome' is required",
            b'{"outcome": "maybe", "source": "operator:a"}': "outcome 'maybe'",
            b'{"outcome": "applied", "source": ""}': "source ''",
            b'{"outcome": "applied", "source": "   "}': "source '   '",
            b'{"outcome": "applied", "source": "op\\nerator"}': "printable",
            b'{"outcome": "applied", "source": 7}': "wrong type",
            b'{"outcome": "applied", "source": "operator:a", "note": 1}': "wrong type",
            b'{"outcome": "applied", "source": "operator:a", "why": "x"}': "unknown field",
            b'{"outcome": null, "source": "operator:a"}': "wrong type",
        }
        answers = {}
        for body, why in cases.items():
            status, answer = await api(
                session, gateway.url, "POST", f"/receipts/{receipt_id}/resolve", data=body
            )
            answers[body] = (status, answer["code"], why in answer["detail"])
        _, receipt = await api(session, gateway.url, "GET", f"/receipts/{receipt_id}")

        assert answers == {body: (400, "invalid_request", True) for body in cases}
        assert receipt["status"] == "outcome_unknown"

    async def test_an_unknown_query_parameter_is_400(
        self, gateway: GatewayProcess, session
    ) -> None:
        status, answer = await api(
            session,
            gateway.url,
            "POST",
            "/receipts/x/resolve?force=true",
            json={"outcome": "applied", "source": "operator:a"},
        )
        assert (status, answer["code"]) == (400, "invalid_request")


class TestProbe:
    """The policy's probe asks the tool's own record and resolves what it can."""

    async def test_probe_resolves_applied_from_the_tools_record(
        self, gateway: GatewayProcess, ledger: Ledger, upstream: RecordingUpstream, session
    ) -> None:
        # A client key with characters a path would misread: it reaches the tool intact.
        key = "order/42?retry#1%"
        receipt_id = await lose(session, gateway, ledger, key, "apply+drop")
        await past_grace()
        status, receipt = await api(session, gateway.url, "POST", f"/receipts/{receipt_id}/probe")
        retry = await post(session, gateway.url, "ledger/r1", key)

        assert status == 200, receipt
        assert pick(receipt, ("id", "status")) == {"id": receipt_id, "status": "reconciled"}
        assert pick(receipt["resolution"], ("outcome", "source")) == {
            "outcome": "applied",
            "source": "policy:probe",
        }
        assert "probe" not in receipt
        probes = upstream.received(method="GET")
        assert [p.path_qs for p in probes] == ["/api/operations/order%2F42%3Fretry%231%25"]
        sent = probes[0].headers
        assert sent["X-Receipt-Id"] == receipt_id
        assert [
            h for h in ("Idempotency-Key", "X-Fence-Token", "X-Lease-Resource") if h in sent
        ] == []
        assert pick(problem(retry), ("status", "code", "receipt_id")) == {
            "status": 409,
            "code": "already_completed",
            "receipt_id": receipt_id,
        }
        assert ledger.applied == {key: 1}
        assert await metric_samples(
            session, gateway.url, "fence_gateway_reconciliations_total"
        ) == {'outcome="applied",source="policy"': 1.0}

    async def test_probe_resolves_not_applied_and_the_retry_applies_once(
        self, gateway: GatewayProcess, ledger: Ledger, session
    ) -> None:
        receipt_id = await lose(session, gateway, ledger, "k-never", "drop")
        await past_grace()
        status, receipt = await api(session, gateway.url, "POST", f"/receipts/{receipt_id}/probe")
        retry = await post(session, gateway.url, "ledger/r1", "k-never")

        assert (status, receipt["status"], receipt["resolution"]["outcome"]) == (
            200,
            "reconciled",
            "not_applied",
        )
        assert retry.status == 201
        assert ledger.applied == {"k-never": 1}

    async def test_an_unclear_answer_leaves_the_receipt_unknown(
        self, gateway: GatewayProcess, ledger: Ledger, upstream: RecordingUpstream, session
    ) -> None:
        ledger.probe_answers["k-500"] = Behavior(status=500, body=b"oops")
        ledger.probe_answers["k-302"] = Behavior(status=302, headers={"Location": "/elsewhere"})
        ledger.probe_answers["k-gone"] = Behavior(action="close")
        lost = {
            key: await lose(session, gateway, ledger, key, "apply+drop")
            for key in ("k-500", "k-302", "k-gone")
        }
        await past_grace()
        answers = {
            key: await api(session, gateway.url, "POST", f"/receipts/{receipt_id}/probe")
            for key, receipt_id in lost.items()
        }

        shown = {
            key: (status, body["status"], body["resolution"], body["probe"])
            for key, (status, body) in answers.items()
        }
        error = shown["k-gone"][3].pop("error")
        assert "broke the connection" in error
        assert shown == {
            "k-500": (200, "outcome_unknown", None, {"status": 500}),
            "k-302": (200, "outcome_unknown", None, {"status": 302}),
            "k-gone": (200, "outcome_unknown", None, {"status": None}),
        }
        assert len(upstream.received(method="GET")) == 3  # once each, never retried
        _, queue = await api(session, gateway.url, "GET", "/reconciliation")
        assert len(queue["items"]) == 3

    async def test_probe_is_refused_without_a_probe_or_before_grace(
        self, gateway: GatewayProcess, ledger: Ledger, upstream: RecordingUpstream, session
    ) -> None:
        ledger.plan("k-plain", "drop")
        ledger.plan("k-slow", "drop")
        plain = await post(session, gateway.url, "plain/r1", "k-plain")
        slow = await post(session, gateway.url, "slowpoke/r1", "k-slow", mount="/slow")
        done = await post(session, gateway.url, "ledger/r1", "k-done")
        await past_grace()
        answers = [
            await api(session, gateway.url, "POST", f"/receipts/{r.headers['X-Receipt-Id']}/probe")
            for r in (plain, slow, done)
        ]
        missing = await api(session, gateway.url, "POST", "/receipts/nope/probe")

        assert [(s, b["code"]) for s, b in answers] == [(409, "not_reconcilable")] * 3
        assert "no probe" in answers[0][1]["detail"]
        assert "reconcilable from" in answers[1][1]["detail"]
        assert "is succeeded" in answers[2][1]["detail"]
        assert (missing[0], missing[1]["code"]) == (404, "not_found")
        assert upstream.received(method="GET") == []  # refused before probing


class TestReceiptPages:
    """Cursors never skip or repeat a receipt, also while receipts are being written."""

    async def test_2500_receipts_page_through_without_gap_or_duplicate(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await gateway_factory(policy(upstream.url))
        counter = iter(range(10**9))
        limiter = asyncio.Semaphore(32)

        async def one() -> None:
            async with limiter:
                n = next(counter)
                result = await post(session, gateway.url, f"many/r{n % 8}", f"k-{n}")
                assert result.status == 200, result

        await asyncio.gather(*(one() for _ in range(2500)))

        stop = asyncio.Event()

        async def keep_adding() -> None:
            while not stop.is_set():
                await asyncio.gather(*(one() for _ in range(32)))

        writer = asyncio.create_task(keep_adding())
        passes = {}
        try:
            for name, limits in (("1000", [1000]), ("100/1000", [100, 1000, 100, 357])):
                passes[name] = await self.page_through(session, gateway, limits)
        finally:
            stop.set()
            await writer
        final = [r["id"] for r in await fetch_receipts(session, gateway.url)]

        assert len(final) == len(set(final)) and final == sorted(final)
        for name, (seen, sizes, limits_used) in passes.items():
            assert len(seen) >= 2500, name
            assert seen == sorted(set(seen)), f"{name}: a receipt repeated or out of order"
            # No gap: every receipt that exists up to the last one seen was seen.
            assert seen == [i for i in final if i <= seen[-1]], f"{name}: a receipt skipped"
            # next_cursor was set exactly when the page was full.
            full = [size == limit for size, limit in zip(sizes, limits_used, strict=True)]
            assert full[:-1] == [True] * (len(full) - 1) and not full[-1], name
        assert len(final) > 2500  # the writer really wrote during the pages

    @staticmethod
    async def page_through(
        session: aiohttp.ClientSession, gateway: GatewayProcess, limits: list[int]
    ) -> tuple[list[str], list[int], list[int]]:
        seen: list[str] = []
        sizes: list[int] = []
        used: list[int] = []
        params: dict[str, str] = {}
        for page_number in range(1000):
            limit = limits[page_number % len(limits)]
            params["limit"] = str(limit)
            status, page = await api(session, gateway.url, "GET", "/receipts", params=params)
            assert status == 200, page
            seen += [r["id"] for r in page["items"]]
            sizes.append(len(page["items"]))
            used.append(limit)
            assert (page["next_cursor"] is not None) == (len(page["items"]) == limit)
            if page["next_cursor"] is None:
                return seen, sizes, used
            params["cursor"] = page["next_cursor"]
            await asyncio.sleep(0)  # let the writer in between pages
        raise AssertionError("paging did not catch up with the writer")


class TestLateOutcomes:
    """docs/contract.md §3: an outcome arriving after the receipt was turned outcome_unknown.

    In process, so the test can act as another replica on the same store while a call is
    held at the tool: its sweeper deciding this instance is silent, its reconciler resolving.
    """

    @pytest.fixture
    async def gw(self, make_app: AppFactory, upstream: RecordingUpstream) -> InProcessGateway:
        return await make_app(
            policy(upstream.url),
            reconcile_grace_s=0,
            sweep_interval_s=60,  # this instance's own sweeper stays out of the way
        )

    async def hold_a_call(
        self, gw: InProcessGateway, upstream: RecordingUpstream, session, key: str
    ) -> tuple[asyncio.Event, asyncio.Task[CallResult], str]:
        gate = asyncio.Event()
        upstream.script("/api/ops", Behavior(status=201, body=b'{"late": true}', gate=gate))
        task = asyncio.create_task(post(session, gw.url, "ledger/r1", key))
        await upstream.wait_received(1)
        receipt_id = upstream.requests[0].headers["X-Receipt-Id"]
        # Another replica's sweeper finds this instance silent: the receipt is lost to it.
        lost = await gw.store.expire_pending(ReconcileWaits({}, 0.0), 3600.0, frozenset())
        assert sum(lost.values()) == 1
        return gate, task, receipt_id

    async def test_an_outcome_after_outcome_unknown_is_recorded_late(
        self, gw: InProcessGateway, upstream: RecordingUpstream, session
    ) -> None:
        base = gw.url
        gate, task, receipt_id = await self.hold_a_call(gw, upstream, session, "k-1")
        refused = await post(session, base, "ledger/r1", "k-1")
        gate.set()
        answer = await task
        _, receipt = await api(session, base, "GET", f"/receipts/{receipt_id}")
        replay = await post(session, base, "ledger/r1", "k-1")

        assert problem(refused)["code"] == "outcome_unknown"
        assert (answer.status, answer.body) == (201, b'{"late": true}')
        assert pick(receipt, ("status", "late", "http_status", "error", "resolution")) == {
            "status": "succeeded",
            "late": True,
            "http_status": 201,
            "error": None,
            "resolution": None,
        }
        assert (replay.status, replay.headers.get("Idempotent-Replayed")) == (201, "true")
        assert len(upstream.requests) == 1

    async def test_an_outcome_after_reconciliation_is_kept_as_late_outcome_and_alerted(
        self, gw: InProcessGateway, upstream: RecordingUpstream, session, caplog
    ) -> None:
        base = gw.url
        gate, task, receipt_id = await self.hold_a_call(gw, upstream, session, "k-1")
        # ...and another replica's reconciler resolves it (its grace already passed there).
        resolved = await gw.store.resolve(
            receipt_id, "not_applied", "operator:bob", None, ReconcileWaits({}, 0.0)
        )
        assert resolved.status == "reconciled"
        with caplog.at_level(logging.WARNING, logger="fence_gateway"):
            gate.set()
            answer = await task
        _, receipt = await api(session, base, "GET", f"/receipts/{receipt_id}")

        assert answer.status == 201  # the client still hears what the tool said
        assert pick(receipt, ("status", "error", "late", "http_status")) == {
            "status": "reconciled",
            "error": "late_outcome",
            "late": True,
            "http_status": 201,
        }
        assert pick(receipt["resolution"], ("outcome", "source")) == {
            "outcome": "not_applied",
            "source": "operator:bob",
        }
        alerts = [r for r in caplog.records if r.getMessage() == "late_outcome"]
        assert [(a.levelname, a.fields["receipt_id"]) for a in alerts] == [("ERROR", receipt_id)]
