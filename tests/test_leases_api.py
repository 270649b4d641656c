"""The lease API (SPEC 6) and the sweeper's cleanup (SPEC 9), in process.

The real app (`create_app`) runs under aiohttp's test server on a real SQLite file in
`tmp_path`, with its real sweeper every 0.1 s, in front of a real recording upstream. The
cleanup's bookkeeping is also tested on the store itself, where races can be staged exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from gateway.config.policy_files import load_policies
from gateway.config.settings import Settings
from gateway.core.receipts import ReconcileWaits
from gateway.core.times import parse_rfc3339
from gateway.proxy import appkeys
from gateway.server.app import create_app
from gateway.store.sqlite import SqliteStore
from gateway.upkeep.cleanup import Cleaner
from tests.harness import Behavior, RecordingUpstream, make_policy, wait_for, write_policy

API = "/_gateway/v1/leases"
LEASE_FIELDS = {"resource", "owner", "fence", "state", "acquired_at", "renewed_at", "expires_at"}
CLEANUP = {"method": "DELETE", "path": "/sessions/{name}?resource={resource}&fence={fence}"}


def rules() -> list[dict[str, Any]]:
    gateway = {"issuer": "gateway"}
    return [
        {"match": "run/*", "lease": gateway | {"ttl_s": 1, "max_ttl_s": 5}},
        {"match": "slow/*", "lease": gateway | {"ttl_s": 0.3, "max_ttl_s": 5, "lock_delay_s": 3}},
        {"match": "browser/*", "lease": gateway | {"ttl_s": 0.3, "max_ttl_s": 5},
         "on_expiry": CLEANUP},
        {"match": "ext/*", "lease": {"issuer": "external"}},
    ]


@dataclasses.dataclass
class Gateway:
    client: TestClient
    upstream: RecordingUpstream

    @property
    def app(self) -> Any:
        return self.client.server.app

    @property
    def store(self) -> SqliteStore:
        return self.app[appkeys.STORE]

    def metric(self, name: str, **labels: str) -> float:
        value = self.app[appkeys.METRICS].registry.get_sample_value(name, labels)
        return value or 0.0

    async def acquire(self, resource: str, owner: str = "worker-a", ttl_s: float | None = None,
                      key: str | None = None) -> tuple[int, Any, Any]:
        body: dict[str, Any] = {"owner": owner}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        headers = {"Idempotency-Key": key} if key else {}
        async with self.client.post(f"{API}/{resource}", json=body, headers=headers) as resp:
            return resp.status, resp.headers, await resp.json(content_type=None)

    async def send(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any, Any]:
        async with self.client.request(method, path, **kwargs) as resp:
            text = await resp.text()
            return resp.status, resp.headers, json.loads(text) if text else None


GatewayMaker = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def make_gateway(tmp_path: Path, upstream: RecordingUpstream,
                       aiohttp_client: Any) -> AsyncIterator[GatewayMaker]:
    async def make(*, timeout_s: float = 2, **settings: Any) -> Gateway:
        policy_path = write_policy(tmp_path / "policies.yaml",
                                   make_policy(upstream.url, rules(), timeout_s=timeout_s,
                                               inject_headers={"X-Tool-Token": "secret"}))
        options = {"database_url": f"sqlite:///{tmp_path}/gw.db", "policies": str(policy_path),
                   "sweep_interval_s": 0.1, "instance_id": "test-1"} | settings
        app = create_app(Settings(_env_file=None, **options), load_policies(policy_path))
        return Gateway(await aiohttp_client(app), upstream)

    yield make


@pytest.fixture
async def gw(make_gateway: GatewayMaker) -> Gateway:
    return await make_gateway()


def seconds(lease: dict[str, Any], field: str) -> float:
    return parse_rfc3339(lease[field])


class TestAcquire:
    """Acquire is a CAS that issues a new fence; only a keyed retry gets the same lease."""

    async def test_a_free_resource_gives_a_held_lease_with_fence_1(self, gw: Gateway) -> None:
        status, _, lease = await gw.acquire("run/a", "worker-a", ttl_s=2)
        assert status == 201
        assert set(lease) == LEASE_FIELDS
        assert {k: lease[k] for k in ("resource", "owner", "fence", "state")} == {
            "resource": "run/a", "owner": "worker-a", "fence": 1, "state": "held"}
        assert lease["acquired_at"] == lease["renewed_at"]
        assert lease["expires_at"].endswith("Z") and len(lease["expires_at"]) == 24
        assert seconds(lease, "expires_at") - seconds(lease, "acquired_at") == \
            pytest.approx(2, abs=0.002)
        assert gw.metric("fence_gateway_lease_acquisitions_total", result="acquired") == 1

    async def test_ttl_defaults_to_the_rule(self, gw: Gateway) -> None:
        _, _, lease = await gw.acquire("run/a")
        assert seconds(lease, "expires_at") - seconds(lease, "acquired_at") == \
            pytest.approx(1, abs=0.002)

    async def test_a_retry_with_the_same_key_gets_the_same_lease(self, gw: Gateway) -> None:
        first = await gw.acquire("run/a", "worker-a", key="k-1")
        again = await gw.acquire("run/a", "worker-a", key="k-1")
        assert (first[0], again[0]) == (201, 200)
        assert again[2] == first[2]
        assert gw.metric("fence_gateway_lease_acquisitions_total", result="acquired") == 1

    @pytest.mark.parametrize("owner, key", [("worker-a", None), ("worker-a", "k-2"),
                                            ("worker-b", "k-1"), ("worker-b", None)])
    async def test_anyone_else_gets_lease_held(self, gw: Gateway, owner: str,
                                               key: str | None) -> None:
        """Also the same owner name: a restarted run must not inherit its predecessor's token."""
        _, _, lease = await gw.acquire("run/a", "worker-a", ttl_s=3, key="k-1")
        status, headers, problem = await gw.acquire("run/a", owner, key=key)
        assert status == 409
        assert headers["Content-Type"].startswith("application/problem+json")
        assert {k: problem[k] for k in ("type", "code", "status", "holder", "expires_at")} == {
            "type": "urn:fence-gateway:lease_held", "code": "lease_held", "status": 409,
            "holder": "worker-a", "expires_at": lease["expires_at"]}
        assert "fence" not in problem  # the holder's token is never shown
        assert headers["Retry-After"] == "3"
        assert gw.metric("fence_gateway_lease_acquisitions_total", result="conflict") == 1

    async def test_retry_after_counts_the_lock_delay_and_is_at_least_1(self,
                                                                       gw: Gateway) -> None:
        _, _, lease = await gw.acquire("slow/a", ttl_s=0.3)
        await asyncio.sleep(0.4)  # expired, but within lock_delay_s = 3
        status, headers, problem = await gw.acquire("slow/a", "worker-b")
        assert (status, problem["code"], problem["holder"]) == (409, "lease_held", "worker-a")
        free_at = seconds(lease, "expires_at") + 3
        assert math.ceil(free_at - time.time()) == 3  # 2.6 s to go: rounded up
        assert headers["Retry-After"] == "3"

    async def test_the_next_owner_gets_the_next_fence(self, gw: Gateway) -> None:
        await gw.acquire("run/a", "worker-a", ttl_s=0.3)
        await asyncio.sleep(0.35)
        status, _, taken = await gw.acquire("run/a", "worker-b")
        assert (status, taken["owner"], taken["fence"]) == (201, "worker-b", 2)
        await gw.send("DELETE", f"{API}/run/a", params={"owner": "worker-b", "fence": "2"})
        status, _, again = await gw.acquire("run/a", "worker-a")
        assert (status, again["fence"]) == (201, 3)

    async def test_a_retried_key_after_expiry_gets_a_new_lease(self, gw: Gateway) -> None:
        """Handing back the dead lease would give the client a fence that cannot act."""
        await gw.acquire("run/a", "worker-a", ttl_s=0.3, key="k-1")
        await asyncio.sleep(0.35)
        status, _, lease = await gw.acquire("run/a", "worker-a", key="k-1")
        assert (status, lease["fence"], lease["state"]) == (201, 2, "held")

    async def test_a_takeover_of_an_unswept_lease_records_its_held_time(
            self, make_gateway: GatewayMaker) -> None:
        gw = await make_gateway(sweep_interval_s=60)  # the sweeper never marks it
        await gw.acquire("run/a", "worker-a", ttl_s=0.3)
        await asyncio.sleep(0.35)
        assert (await gw.acquire("run/a", "worker-b"))[0] == 201
        assert gw.metric("fence_gateway_lease_held_seconds_count") == 1
        assert gw.metric("fence_gateway_lease_held_seconds_sum") == pytest.approx(0.3, abs=0.01)


BAD_ACQUIRES = [
    # (case, path, body bytes, headers, status, code)
    ("not json", "run/a", b'{"owner": ', {}, 400, "invalid_request"),
    ("not an object", "run/a", b'["worker-a"]', {}, 400, "invalid_request"),
    ("unknown field", "run/a", b'{"owner": "w", "ttl": 3}', {}, 400, "invalid_request"),
    ("owner missing", "run/a", b'{"ttl_s": 3}', {}, 400, "invalid_request"),
    ("owner empty", "run/a", b'{"owner": ""}', {}, 400, "invalid_request"),
    ("owner too long", "run/a", json.dumps({"owner": "w" * 129}).encode(), {}, 400,
     "invalid_request"),
    ("owner bad char", "run/a", b'{"owner": "worker a"}', {}, 400, "invalid_request"),
    ("owner not a string", "run/a", b'{"owner": 7}', {}, 400, "invalid_request"),
    ("ttl over max", "run/a", b'{"owner": "w", "ttl_s": 5.001}', {}, 400, "invalid_request"),
    ("ttl zero", "run/a", b'{"owner": "w", "ttl_s": 0}', {}, 400, "invalid_request"),
    ("ttl negative", "run/a", b'{"owner": "w", "ttl_s": -1}', {}, 400, "invalid_request"),
    ("ttl a string", "run/a", b'{"owner": "w", "ttl_s": "3"}', {}, 400, "invalid_request"),
    ("ttl a bool", "run/a", b'{"owner": "w", "ttl_s": true}', {}, 400, "invalid_request"),
    ("ttl NaN", "run/a", b'{"owner": "w", "ttl_s": NaN}', {}, 400, "invalid_request"),
    ("ttl huge int", "run/a", b'{"owner": "w", "ttl_s": 1' + b"0" * 400 + b"}", {}, 400,
     "invalid_request"),
    ("gw- key", "run/a", b'{"owner": "w"}', {"Idempotency-Key": "gw-1"}, 400,
     "invalid_idempotency_key"),
    ("unknown parameter", "run/a?ttl_s=3", b'{"owner": "w"}', {}, 400, "invalid_request"),
    ("bad resource char", "run/a%20b", b'{"owner": "w"}', {}, 400, "invalid_resource"),
    ("empty segment", "run/a/", b'{"owner": "w"}', {}, 400, "invalid_resource"),
    ("resource too long", "run/" + "a" * 253, b'{"owner": "w"}', {}, 400, "invalid_resource"),
    ("no rule", "other/a", b'{"owner": "w"}', {}, 403, "resource_not_allowed"),
    ("external issuer", "ext/a", b'{"owner": "w"}', {}, 403, "resource_not_allowed"),
]


class TestBadRequests:
    """Every bad input is a problem+json 4xx, and nothing is acquired."""

    @pytest.mark.parametrize("case, path, body, headers, status, code", BAD_ACQUIRES,
                             ids=[c[0] for c in BAD_ACQUIRES])
    async def test_bad_acquire(self, gw: Gateway, case: str, path: str, body: bytes,
                               headers: dict[str, str], status: int, code: str) -> None:
        got = await gw.send("POST", f"{API}/{path}", data=body,
                            headers={"Content-Type": "application/json", **headers})
        assert (got[0], got[1]["Content-Type"].split(";")[0], got[2]["code"]) == \
            (status, "application/problem+json", code)
        assert await gw.store.list_leases(None, None, None, 10) == []

    @pytest.mark.parametrize("method", ["PUT", "DELETE", "GET"])
    async def test_an_unknown_resource_is_not_allowed(self, gw: Gateway, method: str) -> None:
        got = await gw.send(method, f"{API}/other/a", json={"owner": "w", "fence": 1},
                            params={"owner": "w", "fence": "1"} if method == "DELETE" else {})
        assert (got[0], got[2]["code"]) == (403, "resource_not_allowed")


class TestRenew:
    """Renew extends the current lease; anything but its live holder gets lease_lost."""

    async def test_renew_moves_the_expiry(self, gw: Gateway) -> None:
        _, _, lease = await gw.acquire("run/a", ttl_s=2)
        await asyncio.sleep(0.1)
        status, _, renewed = await gw.send("PUT", f"{API}/run/a",
                                           json={"owner": "worker-a", "fence": 1, "ttl_s": 3})
        assert status == 200
        assert {k: renewed[k] for k in ("resource", "owner", "fence", "state", "acquired_at")} \
            == {k: lease[k] for k in ("resource", "owner", "fence", "state", "acquired_at")}
        assert seconds(renewed, "renewed_at") >= seconds(lease, "acquired_at") + 0.1
        assert seconds(renewed, "expires_at") - seconds(renewed, "renewed_at") == \
            pytest.approx(3, abs=0.002)
        # without ttl_s: the rule's ttl_s
        _, _, again = await gw.send("PUT", f"{API}/run/a", json={"owner": "worker-a", "fence": 1})
        assert seconds(again, "expires_at") - seconds(again, "renewed_at") == \
            pytest.approx(1, abs=0.002)
        assert gw.metric("fence_gateway_lease_renewals_total", result="renewed") == 2

    @pytest.mark.parametrize("body", [{"owner": "worker-b", "fence": 1},
                                      {"owner": "worker-a", "fence": 2}])
    async def test_not_the_holder_is_lease_lost(self, gw: Gateway, body: dict) -> None:
        await gw.acquire("run/a")
        status, _, problem = await gw.send("PUT", f"{API}/run/a", json=body)
        assert (status, problem["code"]) == (409, "lease_lost")
        assert gw.metric("fence_gateway_lease_renewals_total", result="lost") == 1

    async def test_an_expired_or_released_lease_is_lost(self, gw: Gateway) -> None:
        await gw.acquire("run/a", ttl_s=0.3)
        await asyncio.sleep(0.35)
        got = await gw.send("PUT", f"{API}/run/a", json={"owner": "worker-a", "fence": 1})
        assert (got[0], got[2]["code"]) == (409, "lease_lost")
        await gw.acquire("run/b")
        await gw.send("DELETE", f"{API}/run/b", params={"owner": "worker-a", "fence": "1"})
        got = await gw.send("PUT", f"{API}/run/b", json={"owner": "worker-a", "fence": 1})
        assert (got[0], got[2]["code"]) == (409, "lease_lost")

    @pytest.mark.parametrize("body", [
        {"owner": "worker-a"}, {"fence": 1}, {"owner": "worker-a", "fence": 0},
        {"owner": "worker-a", "fence": -3}, {"owner": "worker-a", "fence": "1"},
        {"owner": "worker-a", "fence": True}, {"owner": "worker-a", "fence": 1.0},
        {"owner": "worker-a", "fence": 2**63}, {"owner": "worker-a", "fence": 1, "ttl_s": 6},
        {"owner": "worker-a", "fence": 1, "extra": 1}])
    async def test_bad_renewals(self, gw: Gateway, body: dict) -> None:
        await gw.acquire("run/a")
        got = await gw.send("PUT", f"{API}/run/a", json=body)
        assert (got[0], got[2]["code"]) == (400, "invalid_request")


class TestRelease:
    """Release by the holder, revoke by force; both free the resource for a new fence."""

    async def test_release_frees_the_resource(self, gw: Gateway) -> None:
        await gw.acquire("run/a", ttl_s=3)
        status, _, body = await gw.send("DELETE", f"{API}/run/a",
                                        params={"owner": "worker-a", "fence": "1"})
        assert (status, body) == (204, None)
        _, _, lease = await gw.send("GET", f"{API}/run/a")
        assert (lease["state"], lease["fence"]) == ("released", 1)
        assert gw.metric("fence_gateway_lease_held_seconds_count") == 1
        # the holder releasing again is fine; the next owner gets a new fence at once
        again = await gw.send("DELETE", f"{API}/run/a", params={"owner": "worker-a", "fence": "1"})
        assert again[0] == 204
        assert (await gw.acquire("run/a", "worker-b"))[2]["fence"] == 2

    async def test_a_lease_that_expired_untaken_releases_fine(self, gw: Gateway) -> None:
        await gw.acquire("run/a", ttl_s=0.3)
        await asyncio.sleep(0.35)
        got = await gw.send("DELETE", f"{API}/run/a", params={"owner": "worker-a", "fence": "1"})
        assert got[0] == 204

    @pytest.mark.parametrize("query", [{"owner": "worker-b", "fence": "1"},
                                       {"owner": "worker-a", "fence": "2"}])
    async def test_anyone_else_is_lease_lost(self, gw: Gateway, query: dict) -> None:
        await gw.acquire("run/a")
        got = await gw.send("DELETE", f"{API}/run/a", params=query)
        assert (got[0], got[2]["code"]) == (409, "lease_lost")
        assert (await gw.send("GET", f"{API}/run/a"))[2]["state"] == "held"

    async def test_a_taken_over_lease_is_lost_to_its_old_holder(self, gw: Gateway) -> None:
        await gw.acquire("run/a", ttl_s=0.3)
        await asyncio.sleep(0.35)
        await gw.acquire("run/a", "worker-b")
        got = await gw.send("DELETE", f"{API}/run/a", params={"owner": "worker-a", "fence": "1"})
        assert (got[0], got[2]["code"]) == (409, "lease_lost")

    async def test_revoke(self, gw: Gateway) -> None:
        await gw.acquire("run/a", ttl_s=3)
        got = await gw.send("DELETE", f"{API}/run/a", params={"force": "true"})
        assert got[0] == 204
        assert (await gw.send("GET", f"{API}/run/a"))[2]["state"] == "released"
        status, _, lease = await gw.acquire("run/a", "worker-b")
        assert (status, lease["fence"]) == (201, 2)
        assert (await gw.send("DELETE", f"{API}/never/leased", params={"force": "true"}))[0] \
            == 403

    async def test_revoking_an_expired_lease_skips_the_lock_delay(self, gw: Gateway) -> None:
        await gw.acquire("slow/a", ttl_s=0.3)
        await asyncio.sleep(0.45)  # expired (and marked by the sweeper), lock delay 3 s
        assert (await gw.acquire("slow/a", "worker-b"))[0] == 409
        assert (await gw.send("DELETE", f"{API}/slow/a", params={"force": "true"}))[0] == 204
        status, _, lease = await gw.acquire("slow/a", "worker-b")
        assert (status, lease["fence"]) == (201, 2)

    @pytest.mark.parametrize("query", [
        {}, {"owner": "worker-a"}, {"fence": "1"}, {"owner": "worker-a", "fence": "01"},
        {"owner": "worker-a", "fence": "0"}, {"owner": "worker-a", "fence": "x"},
        {"owner": "", "fence": "1"}, {"force": "yes"}, {"force": "true", "owner": "worker-a"},
        {"owner": "worker-a", "fence": "1", "ttl_s": "3"}])
    async def test_bad_releases(self, gw: Gateway, query: dict) -> None:
        await gw.acquire("run/a")
        got = await gw.send("DELETE", f"{API}/run/a", params=query)
        assert (got[0], got[2]["code"]) == (400, "invalid_request")


class TestRead:
    """GET shows any lease record (expiry by the store's clock); lists page by resource."""

    async def test_get(self, gw: Gateway) -> None:
        _, _, lease = await gw.acquire("run/a", ttl_s=0.3)
        status, _, shown = await gw.send("GET", f"{API}/run/a")
        assert (status, shown) == (200, lease)
        await asyncio.sleep(0.35)
        assert (await gw.send("GET", f"{API}/run/a"))[2] == lease | {"state": "expired"}
        got = await gw.send("GET", f"{API}/run/never")
        assert (got[0], got[2]["code"]) == (404, "not_found")
        got = await gw.send("GET", f"{API}/run/a", params={"x": "1"})
        assert (got[0], got[2]["code"]) == (400, "invalid_request")

    async def test_list_filters_and_pages(self, gw: Gateway) -> None:
        for name in ("e", "d", "c", "b", "a"):
            await gw.acquire(f"run/{name}", ttl_s=3)
        await gw.acquire("slow/x", ttl_s=0.3)
        await gw.send("DELETE", f"{API}/run/b", params={"owner": "worker-a", "fence": "1"})
        await asyncio.sleep(0.35)

        async def page(**query: str) -> dict[str, Any]:
            status, _, body = await gw.send("GET", API, params=query)
            assert status == 200, body
            return body

        everything = await page()
        assert [(x["resource"], x["state"]) for x in everything["items"]] == [
            ("run/a", "held"), ("run/b", "released"), ("run/c", "held"), ("run/d", "held"),
            ("run/e", "held"), ("slow/x", "expired")]
        assert everything["next_cursor"] is None
        seen, cursor = [], None
        for _ in range(5):
            body = await page(prefix="run/", limit="2", **({"cursor": cursor} if cursor else {}))
            seen += [x["resource"] for x in body["items"]]
            cursor = body["next_cursor"]
            if cursor is None:
                break
        assert seen == ["run/a", "run/b", "run/c", "run/d", "run/e"]
        assert [x["resource"] for x in (await page(state="held"))["items"]] == \
            ["run/a", "run/c", "run/d", "run/e"]
        assert [x["resource"] for x in (await page(state="released"))["items"]] == ["run/b"]
        assert [x["resource"] for x in (await page(state="expired"))["items"]] == ["slow/x"]

    @pytest.mark.parametrize("query", [{"state": "gone"}, {"limit": "0"}, {"limit": "1001"},
                                       {"limit": "x"}, {"cursor": "nope"}, {"owner": "a"}])
    async def test_bad_list_parameters(self, gw: Gateway, query: dict) -> None:
        got = await gw.send("GET", API, params=query)
        assert (got[0], got[2]["code"]) == (400, "invalid_request")


def metric_sample(gw: Gateway, result: str) -> float:
    return gw.metric("fence_gateway_sweeper_cleanups_total", result=result)


class TestSweeperCleanup:
    """An expired lease with `on_expiry` gets its cleanup call, fenced, once, retried on failure."""

    async def test_the_cleanup_call_is_a_fenced_call_of_its_own(self, gw: Gateway) -> None:
        _, _, lease = await gw.acquire("browser/acct-7", ttl_s=0.3)
        await gw.upstream.wait_received(1, method="DELETE", timeout=3)
        await wait_for(lambda: metric_sample(gw, "succeeded") == 1, what="the outcome")
        [sent] = gw.upstream.received(method="DELETE")
        assert sent.path_qs == "/api/sessions/acct-7?resource=browser%2Facct-7&fence=2"
        receipts = (await gw.send("GET", "/_gateway/v1/receipts"))[2]["items"]
        [receipt] = receipts
        assert {k: sent.headers.get(k) for k in (
            "Host", "Idempotency-Key", "X-Lease-Resource", "X-Fence-Token", "X-Receipt-Id",
            "X-Tool-Token")} == {
            "Host": f"127.0.0.1:{gw.upstream.port}", "Idempotency-Key": "gw-sweep-2",
            "X-Lease-Resource": "browser/acct-7", "X-Fence-Token": "2",
            "X-Receipt-Id": receipt["id"], "X-Tool-Token": "secret"}
        assert {k: receipt[k] for k in (
            "resource", "fence", "owner", "client", "upstream", "method", "path",
            "idempotency_key", "attempt", "status", "http_status", "instance")} == {
            "resource": "browser/acct-7", "fence": 2, "owner": "gateway-sweeper:test-1",
            "client": None, "upstream": "tool", "method": "DELETE",
            "path": "/sessions/acct-7?resource=browser%2Facct-7&fence=2",
            "idempotency_key": "gw-sweep-2", "attempt": 1, "status": "succeeded",
            "http_status": 200, "instance": "test-1"}
        # the sweeper released its lease: the resource is free for a new owner at once
        await wait_for(lambda: not gw.app[appkeys.IN_FLIGHT], what="the cleanup to end")
        _, _, swept = await gw.send("GET", f"{API}/browser/acct-7")
        assert (swept["owner"], swept["fence"]) == ("gateway-sweeper:test-1", 2)
        status, _, problem = await gw.send("POST", "/tool/click", headers={
            "X-Lease-Resource": "browser/acct-7", "X-Fence-Token": str(lease["fence"])})
        assert (status, problem["code"]) == (409, "stale_fence")
        assert await gw.store.list_cleanups() == []
        await asyncio.sleep(0.3)  # and it is not repeated
        assert len(gw.upstream.received(method="DELETE")) == 1

    async def test_a_failed_cleanup_is_retried_at_a_later_sweep(self, gw: Gateway) -> None:
        answers = iter([Behavior(status=500), Behavior(status=503), Behavior(status=201)])
        gw.upstream.script("/api/sessions/acct-8", lambda _rec: next(answers))
        await gw.acquire("browser/acct-8", ttl_s=0.3)
        await gw.upstream.wait_received(3, method="DELETE", timeout=5)
        fences = [r.fence for r in gw.upstream.received(method="DELETE")]
        assert fences == [2, 3, 4]  # each attempt under a new sweeper lease, a new key
        await wait_for(lambda: metric_sample(gw, "succeeded") == 1, what="the success")
        assert (metric_sample(gw, "failed"), metric_sample(gw, "unknown")) == (2, 0)
        receipts = (await gw.send("GET", "/_gateway/v1/receipts"))[2]["items"]
        assert [(r["fence"], r["idempotency_key"], r["status"], r["http_status"])
                for r in receipts] == [(2, "gw-sweep-2", "failed", 500),
                                       (3, "gw-sweep-3", "failed", 503),
                                       (4, "gw-sweep-4", "succeeded", 201)]
        assert await gw.store.list_cleanups() == []

    async def test_an_unknown_outcome_waits_for_reconciliation(
            self, make_gateway: GatewayMaker) -> None:
        gw = await make_gateway(timeout_s=0.3, reconcile_grace_s=0)
        answers = iter([Behavior(action="close"), Behavior(status=200)])
        gw.upstream.script("/api/sessions/acct-9", lambda _rec: next(answers))
        await gw.acquire("browser/acct-9", ttl_s=0.3)
        await gw.upstream.wait_received(1, method="DELETE", timeout=3)
        await wait_for(lambda: metric_sample(gw, "unknown") == 1, what="the unknown outcome")
        await asyncio.sleep(0.6)  # several sweeps: not retried while the outcome is unknown
        assert len(gw.upstream.received(method="DELETE")) == 1
        [owed] = await gw.store.list_cleanups()
        assert (owed.sweep_fence, owed.last_error) == (2, "outcome_unknown")
        [receipt] = (await gw.send("GET", "/_gateway/v1/reconciliation"))[2]["items"]
        resolved = await gw.store.resolve(receipt["id"], "not_applied", "operator:test", None,
                                          ReconcileWaits({}, 0.3))
        assert resolved.status == "reconciled"
        await gw.upstream.wait_received(2, method="DELETE", timeout=4)
        await wait_for(lambda: metric_sample(gw, "succeeded") == 1, what="the retry")
        assert [r.fence for r in gw.upstream.received(method="DELETE")] == [2, 3]

    async def test_an_applied_unknown_cleanup_is_not_repeated(
            self, make_gateway: GatewayMaker) -> None:
        gw = await make_gateway(timeout_s=0.3, reconcile_grace_s=0)
        gw.upstream.script("/api/sessions/acct-9", Behavior(action="close"))
        await gw.acquire("browser/acct-9", ttl_s=0.3)
        await wait_for(lambda: metric_sample(gw, "unknown") == 1, what="the unknown outcome")
        [receipt] = (await gw.send("GET", "/_gateway/v1/reconciliation"))[2]["items"]
        await asyncio.sleep(0.3)
        await gw.store.resolve(receipt["id"], "applied", "operator:test", None,
                               ReconcileWaits({}, 0.3))
        for _ in range(40):
            if not await gw.store.list_cleanups():
                break
            await asyncio.sleep(0.1)
        assert await gw.store.list_cleanups() == []
        assert len(gw.upstream.received(method="DELETE")) == 1

    async def test_rules_without_on_expiry_owe_nothing(self, gw: Gateway) -> None:
        await gw.acquire("run/a", ttl_s=0.3)
        await asyncio.sleep(0.5)
        assert (await gw.send("GET", f"{API}/run/a"))[2]["state"] == "expired"
        assert await gw.store.list_cleanups() == []
        assert gw.upstream.requests == []


class TestCleanupBookkeeping:
    """The store's side of cleanups: scheduled with the expiry, kept across restarts, claimed
    by one sweeper at a time, dropped when a new owner took over."""

    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[SqliteStore]:
        store = SqliteStore(tmp_path / "gw.db", instance="test-1")
        await store.open()
        yield store
        await store.close()

    @staticmethod
    def owed(resource: str, owner: str) -> float | None:
        return None if owner.startswith("gateway-sweeper:") or not resource.startswith(
            "browser/") else 0.0

    async def expire(self, store: SqliteStore, resource: str, owner: str = "worker-a") -> None:
        await store.acquire(resource, owner, 0.05, 0, None, None)
        await asyncio.sleep(0.06)
        await store.expire_leases(self.owed)

    async def claim(self, store: SqliteStore, resource: str, owner: str = "gateway-sweeper:s1",
                    ) -> Any:
        return await store.claim_cleanup(resource, owner, 5, 0, 1)

    async def test_scheduled_only_where_owed_and_kept_across_a_restart(
            self, tmp_path: Path) -> None:
        first = SqliteStore(tmp_path / "restart.db", instance="run-1")
        await first.open()
        await self.expire(first, "browser/a")
        await self.expire(first, "run/a")
        await first.close()
        reopened = SqliteStore(tmp_path / "restart.db", instance="run-2")
        await reopened.open()
        try:
            owed = await reopened.list_cleanups()
            assert [(o.resource, o.lease_fence, o.lease_owner, o.attempts,
                     o.sweep_fence) for o in owed] == [("browser/a", 1, "worker-a", 0, None)]
            assert await reopened.due_cleanups(10) == ["browser/a"]
        finally:
            await reopened.close()

    async def test_two_sweepers_claim_it_once(self, store: SqliteStore) -> None:
        await self.expire(store, "browser/a")
        first, second = await asyncio.gather(self.claim(store, "browser/a"),
                                              self.claim(store, "browser/a", "gateway-sweeper:s2"))
        assert sorted([first.state, second.state]) == ["busy", "claimed"]
        won = first if first.state == "claimed" else second
        assert (won.fence, won.key, won.attempt, won.lease_fence, won.lease_owner) == \
            (2, "gw-sweep-2", 1, 1, "worker-a")

    async def test_a_finished_cleanup_is_not_claimed_again(self, store: SqliteStore) -> None:
        await self.expire(store, "browser/a")
        claim = await self.claim(store, "browser/a")
        await store.finish_cleanup("browser/a", claim.fence, done=True)
        await store.release("browser/a", "gateway-sweeper:s1", claim.fence)
        assert (await self.claim(store, "browser/a", "gateway-sweeper:s2")).state == "not_due"
        assert await store.list_cleanups() == []

    async def test_a_new_owner_supersedes_it(self, store: SqliteStore) -> None:
        await self.expire(store, "browser/a")
        taken = await store.acquire("browser/a", "worker-b", 5, 0, None, None)
        assert (taken.result, taken.lease.fence) == ("acquired", 2)
        superseded = await self.claim(store, "browser/a")
        assert (superseded.state, superseded.holder) == ("superseded", "worker-b")
        assert await store.list_cleanups() == []

    async def test_a_newer_expiry_replaces_an_older_one(self, store: SqliteStore) -> None:
        await self.expire(store, "browser/a")
        await self.expire(store, "browser/a", "worker-b")
        [owed] = await store.list_cleanups()
        assert (owed.lease_fence, owed.lease_owner) == (2, "worker-b")

    async def test_a_failed_attempt_is_tried_again_under_a_new_fence(
            self, store: SqliteStore) -> None:
        await self.expire(store, "browser/a")
        claim = await self.claim(store, "browser/a")
        await store.finish_cleanup("browser/a", claim.fence, done=False, retry_at=time.time(),
                                   error="http_500")
        await store.release("browser/a", "gateway-sweeper:s1", claim.fence)
        again = await self.claim(store, "browser/a")
        assert (again.state, again.fence, again.attempt) == ("claimed", 3, 2)

    async def test_an_interrupted_attempt_waits_then_its_expiry_owes_nothing_new(
            self, store: SqliteStore) -> None:
        """A sweeper that died mid-call leaves a pending receipt-less claim and a held lease:
        the next claim waits for that lease; its expiry schedules nothing of its own."""
        await self.expire(store, "browser/a")
        claim = await store.claim_cleanup("browser/a", "gateway-sweeper:s1", 0.3, 0, 0)
        assert (await store.claim_cleanup("browser/a", "gateway-sweeper:s2", 5, 0, 0)).state \
            == "busy"
        await asyncio.sleep(0.35)
        await store.expire_leases(self.owed)
        [owed] = await store.list_cleanups()
        assert (owed.lease_fence, owed.sweep_fence) == (1, claim.fence)
        retried = await self.claim(store, "browser/a", "gateway-sweeper:s2")
        assert (retried.state, retried.fence) == ("claimed", 3)


class TestCleanerRules:
    """Which expired leases owe a cleanup."""

    async def test_owed_after(self, gw: Gateway) -> None:
        cleaner = Cleaner(gw.app)
        assert cleaner.owed_after("browser/a", "worker-a") == 0
        assert cleaner.owed_after("browser/a", "gateway-sweeper:x") is None
        assert cleaner.owed_after("run/a", "worker-a") is None
        assert cleaner.owed_after("nothing/a", "worker-a") is None
