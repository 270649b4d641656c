"""Checkpoints and the run view against a real gateway process (docs/contract.md §17).

Worker A checkpoints a long task, makes a call that completes and one whose outcome is lost
(the gateway is killed while the tool holds the call), and its lease is taken over by worker
B. A's next checkpoint is refused and writes nothing; B's run view shows A's last
checkpoint, the call completed after it, and the lost one as needing confirmation, first
`outcome_unknown`, then `reconciliation_required` once past its grace.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from gateway.client import GatewayClient, LeaseLost
from gateway.core.times import parse_rfc3339
from tests.harness import (
    Behavior,
    GatewayFactory,
    GatewayProcess,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    make_policy,
    pick,
    problem,
    wait_for,
)

RESOURCE = "task/run-1"
KEYS = {"agent-a": "key-a", "agent-b": "key-b", "recon": "key-recon", "other": "key-other"}
TIMEOUT_S = 5.0  # the tool's timeout_s
GRACE_S = 1.0  # GATEWAY_RECONCILE_GRACE_S: past timeout_s + this, a lost call may be reconciled


def clients_file(path: Path) -> Path:
    roles = {"agent-a": "agent", "agent-b": "agent", "recon": "reconciler", "other": "agent"}
    lines = ["clients:"]
    for name, key in KEYS.items():
        digest = hashlib.sha256(key.encode()).hexdigest()
        scope = ", resources: ['task/*']" if name.startswith("agent") else ""
        if name == "other":
            scope = ", resources: ['elsewhere/*']"
        lines.append(f"  - {{name: {name}, key_sha256: '{digest}', roles: [{roles[name]}]{scope}}}")
    path.write_text("\n".join(lines) + "\n")
    return path


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def proxy(name: str) -> dict[str, str]:
    return {"Proxy-Authorization": f"Bearer {KEYS[name]}"}


async def api(
    session: aiohttp.ClientSession,
    gateway: GatewayProcess,
    method: str,
    path: str,
    who: str | None = None,
    **kwargs: Any,
) -> tuple[int, Any]:
    headers = {**(bearer(who) if who else {}), **kwargs.pop("headers", {})}
    async with session.request(
        method, f"{gateway.url}/_gateway/v1{path}", headers=headers, **kwargs
    ) as resp:
        body = await resp.read()
        return resp.status, json.loads(body) if body else None


async def checkpoint(
    session: aiohttp.ClientSession,
    gateway: GatewayProcess,
    who: str,
    fence: int,
    step: str,
    state: Any,
    **extra: str,
) -> tuple[int, Any]:
    return await api(
        session,
        gateway,
        "PUT",
        f"/checkpoints/{RESOURCE}",
        who,
        headers={"X-Fence-Token": str(fence), **extra},
        json={"step": step, "state": state},
    )


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def test_a_replacement_worker_sees_where_its_predecessor_got_to(
    tmp_path: Path,
    upstream: RecordingUpstream,
    gateway_factory: GatewayFactory,
    session: aiohttp.ClientSession,
) -> None:
    gateway = await gateway_factory(
        make_policy(
            upstream.url,
            [{"match": "task/*", "lease": {"issuer": "gateway", "ttl_s": 1, "max_ttl_s": 60}}],
            timeout_s=TIMEOUT_S,
        ),
        extra_env={
            "GATEWAY_CLIENTS": str(clients_file(tmp_path / "clients.yaml")),
            "GATEWAY_RECONCILE_GRACE_S": str(GRACE_S),
        },
    )
    status, lease_a = await api(
        session, gateway, "POST", f"/leases/{RESOURCE}", "agent-a", json={"owner": "run-a"}
    )
    assert status == 201, lease_a
    fence_a = lease_a["fence"]

    # A: the first step, then its checkpoint, written once however often it is retried
    first = await call(
        session,
        "POST",
        f"{gateway.url}/tool/prepare",
        json={"order": 7},
        headers={**fenced_headers(RESOURCE, fence_a), **proxy("agent-a")},
    )
    assert first.status == 200
    state = {"order": 7, "prepared": True, "items": [1, 2]}
    status, written = await checkpoint(session, gateway, "agent-a", fence_a, "prepared", state)
    assert status == 201, written
    assert pick(written, ("resource", "seq", "fence", "owner", "client", "step", "state")) == {
        "resource": RESOURCE,
        "seq": 1,
        "fence": fence_a,
        "owner": "run-a",
        "client": "agent-a",
        "step": "prepared",
        "state": state,
    }
    reordered = {"items": [1, 2], "prepared": True, "order": 7}
    status, again = await checkpoint(session, gateway, "agent-a", fence_a, "prepared", reordered)
    assert (status, again) == (200, written)

    # A: a call that completes, then one whose outcome is lost with the gateway
    charged = await call(
        session,
        "POST",
        f"{gateway.url}/tool/charge",
        json={"order": 7},
        headers={**fenced_headers(RESOURCE, fence_a), **proxy("agent-a")},
    )
    assert charged.status == 200
    upstream.script("/api/ship", Behavior(delay=2.0))
    ship = asyncio.create_task(
        call(
            session,
            "POST",
            f"{gateway.url}/tool/ship",
            json={"order": 7},
            headers={**fenced_headers(RESOURCE, fence_a), **proxy("agent-a")},
        )
    )
    await upstream.wait_received(3)
    await gateway.kill9()  # the tool has the call; its answer will never be recorded
    assert (await ship).status is None
    await gateway.restart()

    # B takes the resource over once A's lease has expired (A is gone)
    async def take_over() -> bool:
        status, lease = await api(
            session,
            gateway,
            "POST",
            f"/leases/{RESOURCE}",
            "agent-b",
            json={"owner": "run-b", "ttl_s": 30},
        )
        taken.update(lease if status == 201 else {})
        return status == 201

    taken: dict[str, Any] = {}
    await wait_for(take_over, timeout=5, what="B's acquire")
    fence_b = taken["fence"]
    assert fence_b > fence_a

    # who may: agents their own resources only; reconcilers read; no key, no entry
    for who, method, path, expected in [
        ("other", "PUT", "checkpoints", (403, "forbidden")),
        ("recon", "PUT", "checkpoints", (403, "forbidden")),
        ("other", "GET", "checkpoints", (403, "forbidden")),
        ("other", "GET", "resources", (403, "forbidden")),
        (None, "GET", "resources", (401, "unauthenticated")),
    ]:
        status, body = await api(
            session,
            gateway,
            method,
            f"/{path}/{RESOURCE}",
            who,
            headers={"X-Fence-Token": str(fence_a)},
            json={"step": "x", "state": 1} if method == "PUT" else None,
        )
        assert (status, body["code"]) == expected, (who, method, path, body)

    # A, fenced out, cannot move the checkpoint: nothing is written
    status, refused = await checkpoint(session, gateway, "agent-a", fence_a, "shipped", {})
    assert (status, refused["code"]) == (409, "stale_fence"), refused
    assert "highest" not in json.dumps(refused)  # no live fence in the problem
    status, page = await api(session, gateway, "GET", f"/checkpoints/{RESOURCE}", "agent-b")
    assert (status, [c["seq"] for c in page["items"]]) == (200, [1])

    # B's run view: A's last checkpoint, the call completed after it, the lost one
    asked_at = time.time()
    status, view = await api(session, gateway, "GET", f"/resources/{RESOURCE}", "agent-b")
    answered_at = time.time()
    assert status == 200, view
    # The lost call may be reconciled from its forwarded_at + timeout_s + grace on: before
    # that the view says outcome_unknown. (A machine slow enough to restart the gateway past
    # that moment sees the later state; the test still checks it is the right one.)
    left = parse_rfc3339(view["since_checkpoint"]["needs_confirmation"][0]["forwarded_at"])
    ready = left + TIMEOUT_S + GRACE_S
    if answered_at < ready:
        assert view["state"] == "outcome_unknown"
    elif asked_at >= ready:
        assert view["state"] == "reconciliation_required"
    assert "highest_fence" not in view  # an agent is not shown it
    assert view["checkpoint"] == written
    assert (view["lease"]["owner"], view["lease"]["fence"]) == ("run-b", fence_b)
    since = view["since_checkpoint"]
    assert [(r["path"], r["status"]) for r in since["completed"]] == [("/charge", "succeeded")]
    assert [(r["path"], r["status"]) for r in since["needs_confirmation"]] == [
        ("/ship", "outcome_unknown")
    ]
    assert since["rejected"] == 0
    lost_id = since["needs_confirmation"][0]["id"]

    # past the call's timeout and the grace, it is for a reconciler
    async def reconcilable() -> bool:
        _, seen = await api(session, gateway, "GET", f"/resources/{RESOURCE}", "agent-b")
        return bool(seen["state"] == "reconciliation_required")

    await wait_for(reconcilable, timeout=TIMEOUT_S + GRACE_S + 3, what="past the grace")
    status, full = await api(session, gateway, "GET", f"/resources/{RESOURCE}", "recon")
    assert (status, full["highest_fence"]) == (200, fence_b)  # a reconciler sees it
    status, _ = await api(
        session,
        gateway,
        "POST",
        f"/receipts/{lost_id}/resolve",
        "recon",
        json={"outcome": "applied", "source": "operator:test"},
    )
    assert status == 200

    # B goes on: its checkpoint starts a new stretch
    status, view = await api(session, gateway, "GET", f"/resources/{RESOURCE}", "agent-b")
    assert view["state"] == "lease_valid"
    assert [r["status"] for r in view["since_checkpoint"]["completed"]][-1] == "reconciled"
    status, mine = await checkpoint(session, gateway, "agent-b", fence_b, "shipped", {"o": 7})
    assert (status, mine["seq"], mine["owner"]) == (201, 2, "run-b")
    status, view = await api(session, gateway, "GET", f"/resources/{RESOURCE}", "agent-b")
    assert view["checkpoint"]["step"] == "shipped"
    assert view["since_checkpoint"] == {"completed": [], "needs_confirmation": [], "rejected": 0}

    # counted (this process's run: after the restart)
    async with session.get(f"{gateway.url}/_gateway/metrics", headers=bearer("recon")) as resp:
        text = await resp.text()
    # refused: the other agent's and A's stale one (the reconciler's was refused for its
    # role at the edge, before any checkpoint was looked at)
    assert metric(text, 'fence_gateway_checkpoints_total{result="refused"}') == 2
    assert metric(text, 'fence_gateway_checkpoints_total{result="written"}') == 1
    # a checkpoint is no call: the receipts are the three calls' only
    status, page = await api(session, gateway, "GET", f"/receipts?resource={RESOURCE}", "recon")
    assert [r["path"] for r in page["items"]] == ["/prepare", "/charge", "/ship"]


SECRET = "checkpoint-secret"


def signature(resource: str, fence: int) -> str:
    return hmac.new(SECRET.encode(), f"{resource}\n{fence}".encode(), hashlib.sha256).hexdigest()


async def test_bad_inputs_are_refused_as_problems_and_write_nothing(
    upstream: RecordingUpstream, gateway_factory: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gateway = await gateway_factory(
        make_policy(
            upstream.url,
            [
                {"match": "task/*", "lease": {"issuer": "gateway"}},
                {"match": "ext/*", "lease": {"issuer": "external", "hmac_secret_env": "CK_SECRET"}},
            ],
        ),
        extra_env={"CK_SECRET": SECRET},
    )
    url = f"{gateway.url}/_gateway/v1/checkpoints"
    signed = {"X-Fence-Token": "5", "X-Fence-Signature": signature("ext/1", 5)}
    good = {"step": "s", "state": {}}

    async def put(path: str, headers: dict[str, str], **kwargs: Any) -> tuple[int, str]:
        result = await call(session, "PUT", f"{url}/{path}", headers=headers, **kwargs)
        body = problem(result)  # problem+json, status matching
        return body["status"], body["code"]

    big_state = {"s": "x" * (65536 - len('{"s":""}') + 1)}  # one byte over, as compact JSON
    cases: list[tuple[str, dict[str, str], dict[str, Any], tuple[int, str]]] = [
        ("nowhere/1", signed, {"json": good}, (403, "resource_not_allowed")),
        ("ext/%20x", signed, {"json": good}, (400, "invalid_resource")),
        ("ext/1", {}, {"json": good}, (428, "missing_fence")),
        ("ext/1", {"X-Fence-Token": "05"}, {"json": good}, (400, "invalid_fence")),
        ("ext/1", {**signed, "X-Lease-Owner": "a b"}, {"json": good}, (400, "invalid_request")),
        ("ext/1", signed, {"data": b"{not json"}, (400, "invalid_request")),
        ("ext/1", signed, {"data": b'{"step":"s","state":NaN}'}, (400, "invalid_request")),
        ("ext/1", signed, {"json": [good]}, (400, "invalid_request")),
        ("ext/1", signed, {"json": {"step": "s"}}, (400, "invalid_request")),
        ("ext/1", signed, {"json": {**good, "more": 1}}, (400, "invalid_request")),
        ("ext/1", signed, {"json": {"step": "", "state": 1}}, (400, "invalid_request")),
        ("ext/1", signed, {"json": {"step": "x" * 129, "state": 1}}, (400, "invalid_request")),
        ("ext/1", signed, {"json": {"step": "a\nb", "state": 1}}, (400, "invalid_request")),
        ("ext/1", signed, {"json": {"step": 7, "state": 1}}, (400, "invalid_request")),
        ("ext/1", signed, {"json": {"step": "s", "state": big_state}}, (400, "invalid_request")),
        (
            "ext/1",
            signed,
            {"json": {"step": "s", "state": "x" * 140_000}},
            (413, "body_too_large"),
        ),
        (
            "ext/1",
            signed,
            {"data": _chunks(b'{"step":"s","state":"' + b"x" * 140_000 + b'"}')},
            (413, "body_too_large"),
        ),
        ("ext/1", {"X-Fence-Token": "5"}, {"json": good}, (403, "bad_fence_signature")),
        ("task/1", {"X-Fence-Token": "1"}, {"json": good}, (403, "fence_not_issued")),
    ]
    for path, headers, body, expected in cases:
        assert await put(path, headers, **body) == expected, (path, headers, str(body)[:80])

    # the limits themselves are accepted
    at_limits = {"step": "x" * 128, "state": {"s": "é" * ((65536 - 8) // 2)}}
    raw = json.dumps(at_limits, ensure_ascii=False).encode()
    assert (await call(session, "PUT", f"{url}/ext/1", headers=signed, data=raw)).status == 201

    # nothing else was written: one checkpoint, no receipt anywhere
    status, page = await api(session, gateway, "GET", "/checkpoints/ext/1")
    assert (status, [c["step"] for c in page["items"]]) == (200, ["x" * 128])
    status, page = await api(session, gateway, "GET", "/checkpoints/task/1")
    assert (status, page) == (200, {"items": [], "next_cursor": None})
    assert await fetch_receipts(session, gateway.url) == []

    # reading: bad parameters, another method, a resource no rule covers
    for query in ("?cursor=after:5", "?limit=0", "?other=1"):
        result = await call(session, "GET", f"{url}/ext/1{query}")
        assert (problem(result)["status"], problem(result)["code"]) == (400, "invalid_request")
    refused = await call(session, "POST", f"{url}/ext/1", json=good)
    assert problem(refused)["status"] == 405
    assert refused.headers is not None and refused.headers["Allow"] == "GET, HEAD, PUT"
    for path in ("/checkpoints/nowhere/1", "/resources/nowhere/1"):
        result = await call(session, "GET", f"{gateway.url}/_gateway/v1{path}")
        assert problem(result)["code"] == "resource_not_allowed"

    async with session.get(f"{gateway.url}/_gateway/metrics") as resp:
        text = await resp.text()
    assert metric(text, 'fence_gateway_checkpoints_total{result="refused"}') == len(cases)
    assert metric(text, 'fence_gateway_checkpoints_total{result="written"}') == 1


def _chunks(data: bytes) -> Any:
    """A body sent chunked, without Content-Length."""

    async def gen() -> Any:
        for i in range(0, len(data), 16384):
            yield data[i : i + 16384]

    return gen()


async def test_pages_newest_first_and_the_view_of_an_idle_resource(
    upstream: RecordingUpstream, gateway_factory: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gateway = await gateway_factory(make_policy(upstream.url, [{"match": "ext/*"}]))
    for n in range(5):
        result = await call(
            session,
            "PUT",
            f"{gateway.url}/_gateway/v1/checkpoints/ext/p",
            headers={"X-Fence-Token": "3"},
            json={"step": f"s{n}", "state": n},
        )
        assert result.status == 201
    seen, cursor = [], None
    while True:
        query = "?limit=2" + (f"&cursor={cursor}" if cursor else "")
        status, page = await api(session, gateway, "GET", f"/checkpoints/ext/p{query}")
        seen += [c["seq"] for c in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [5, 4, 3, 2, 1]
    status, view = await api(session, gateway, "GET", "/resources/ext/q")
    assert (status, view) == (
        200,
        {
            "resource": "ext/q",
            "state": "idle",
            "lease": None,
            "highest_fence": 0,  # open: no agent to hide it from
            "checkpoint": None,
            "since_checkpoint": {"completed": [], "needs_confirmation": [], "rejected": 0},
        },
    )


async def test_the_client_library_checkpoints_and_resumes(
    upstream: RecordingUpstream, gateway_factory: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gateway = await gateway_factory(
        make_policy(upstream.url, [{"match": "task/*", "lease": {"issuer": "gateway"}}])
    )
    async with GatewayClient(gateway.url) as gw:
        lease_a = gw.lease(RESOURCE, owner="run-a", ttl_s=30)
        await lease_a.acquire()
        first = await lease_a.checkpoint("one", {"n": 1})
        assert (first.seq, first.fence, first.owner, first.state) == (
            1,
            lease_a.fence,
            "run-a",
            {"n": 1},
        )
        assert await lease_a.checkpoint("one", {"n": 1}) == first  # a retry: the same one
        status, _ = await api(session, gateway, "DELETE", f"/leases/{RESOURCE}?force=true")
        assert status == 204
        async with gw.lease(RESOURCE, owner="run-b", ttl_s=30) as lease_b:
            try:
                await lease_a.checkpoint("two", {"n": 2})
                raise AssertionError("a taken-over lease wrote a checkpoint")
            except LeaseLost as exc:
                assert exc.code == "stale_fence"
            assert lease_a.lost
            view = await gw.resume(RESOURCE)
            assert (view.state, view.checkpoint, view.highest_fence) == (
                "lease_valid",
                first,
                lease_b.fence,
            )
            assert view.lease is not None and view.lease.owner == "run-b"
            page, cursor = await gw.checkpoints(RESOURCE)
            assert (page, cursor) == ([first], None)
        await lease_a.release()


async def test_the_sweeper_prunes_past_retention_but_keeps_the_last(
    upstream: RecordingUpstream, gateway_factory: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gateway = await gateway_factory(
        make_policy(
            upstream.url,
            [{"match": "long/*"}, {"match": "short/*", "idempotency": {"retention_s": 0.3}}],
        )
    )
    for path, count in (("short/r", 3), ("long/r", 2)):
        for n in range(count):
            result = await call(
                session,
                "PUT",
                f"{gateway.url}/_gateway/v1/checkpoints/{path}",
                headers={"X-Fence-Token": "1"},
                json={"step": f"s{n}", "state": None},
            )
            assert result.status == 201

    async def only_the_last() -> bool:
        _, page = await api(session, gateway, "GET", "/checkpoints/short/r")
        return [c["seq"] for c in page["items"]] == [3]

    await wait_for(only_the_last, timeout=5, what="the sweeper's pruning")
    _, page = await api(session, gateway, "GET", "/checkpoints/long/r")
    assert [c["seq"] for c in page["items"]] == [2, 1]  # within retention: all kept
