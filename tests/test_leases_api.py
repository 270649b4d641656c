"""The lease API (docs/contract.md §6) and the sweeper's cleanup (§9), in process.

The real app (`create_app`) runs under aiohttp's test server on a real SQLite file in
`tmp_path`, with its real sweeper every 0.1 s, in front of a real recording upstream. The
cleanup's bookkeeping on the store itself, where races can be staged exactly, is part of the
store contract (tests/store/test_contract_cleanups.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import pytest

from gateway.core.receipts import ReconcileWaits
from gateway.core.times import parse_rfc3339
from gateway.proxy import appkeys
from gateway.upkeep.cleanup import Cleaner
from tests.harness import (
    AppFactory,
    Behavior,
    InProcessGateway,
    RecordingUpstream,
    make_policy,
    wait_for,
)

API = "/_gateway/v1/leases"
LEASE_FIELDS = {"resource", "owner", "fence", "state", "acquired_at", "renewed_at", "expires_at"}
CLEANUP = {"method": "DELETE", "path": "/sessions/{name}?resource={resource}&fence={fence}"}


def rules() -> list[dict[str, Any]]:
    gateway = {"issuer": "gateway"}
    return [
        {"match": "run/*", "lease": gateway | {"ttl_s": 1, "max_ttl_s": 5}},
        {"match": "slow/*", "lease": gateway | {"ttl_s": 0.3, "max_ttl_s": 5, "lock_delay_s": 3}},
        {
            "match": "browser/*",
            "lease": gateway | {"ttl_s": 0.3, "max_ttl_s": 5},
            "on_expiry": CLEANUP,
        },
        {"match": "ext/*", "lease": {"issuer": "external"}},
    ]


def lease_policy(upstream_url: str, *, timeout_s: float = 2) -> dict[str, Any]:
    return make_policy(
        upstream_url, rules(), timeout_s=timeout_s, inject_headers={"X-Tool-Token": "secret"}
    )


@pytest.fixture
async def gw(make_app: AppFactory, upstream: RecordingUpstream) -> InProcessGateway:
    return await make_app(lease_policy(upstream.url))


def seconds(lease: dict[str, Any], field: str) -> float:
    return parse_rfc3339(lease[field])


class TestAcquire:
    """Acquire is a CAS that issues a new fence; only a keyed retry gets the same lease."""

    async def test_a_free_resource_gives_a_held_lease_with_fence_1(
        self, gw: InProcessGateway
    ) -> None:
        status, _, lease = await gw.acquire("run/a", "worker-a", ttl_s=2)
        assert status == 201
        assert set(lease) == LEASE_FIELDS
        assert {k: lease[k] for k in ("resource", "owner", "fence", "state")} == {
            "resource": "run/a",
            "owner": "worker-a",
            "fence": 1,
            "state": "held",
        }
        assert lease["acquired_at"] == lease["renewed_at"]
        assert lease["expires_at"].endswith("Z") and len(lease["expires_at"]) == 24
        assert seconds(lease, "expires_at") - seconds(lease, "acquired_at") == pytest.approx(
            2, abs=0.002
        )
        assert gw.metric("fence_gateway_lease_acquisitions_total", result="acquired") == 1

    async def test_ttl_defaults_to_the_rule(self, gw: InProcessGateway) -> None:
        _, _, lease = await gw.acquire("run/a")
        assert seconds(lease, "expires_at") - seconds(lease, "acquired_at") == pytest.approx(
            1, abs=0.002
        )

    async def test_a_retry_with_the_same_key_gets_the_same_lease(
        self, gw: InProcessGateway
    ) -> None:
        first = await gw.acquire("run/a", "worker-a", key="k-1")
        again = await gw.acquire("run/a", "worker-a", key="k-1")
        assert (first[0], again[0]) == (201, 200)
        assert again[2] == first[2]
        assert gw.metric("fence_gateway_lease_acquisitions_total", result="acquired") == 1

    @pytest.mark.parametrize(
        "owner, key",
        [("worker-a", None), ("worker-a", "k-2"), ("worker-b", "k-1"), ("worker-b", None)],
    )
    async def test_anyone_else_gets_lease_held(
        self, gw: InProcessGateway, owner: str, key: str | None
    ) -> None:
        """Also the same owner name: a restarted run must not inherit its predecessor's token."""
        _, _, lease = await gw.acquire("run/a", "worker-a", ttl_s=3, key="k-1")
        status, headers, problem = await gw.acquire("run/a", owner, key=key)
        assert status == 409
        assert headers["Content-Type"].startswith("application/problem+json")
        assert {k: problem[k] for k in ("type", "code", "status", "holder", "expires_at")} == {
            "type": "urn:fence-gateway:lease_held",
            "code": "lease_held",
            "status": 409,
            "holder": "worker-a",
            "expires_at": lease["expires_at"],
        }
        assert "fence" not in problem  # the holder's token is never shown
        assert headers["Retry-After"] == "3"
        assert gw.metric("fence_gateway_lease_acquisitions_total", result="conflict") == 1

    async def test_retry_after_counts_the_lock_delay_and_is_at_least_1(
        self, gw: InProcessGateway
    ) -> None:
        _, _, lease = await gw.acquire("slow/a", ttl_s=0.3)
        await asyncio.sleep(0.4)  # expired, but within lock_delay_s = 3
        status, headers, problem = await gw.acquire("slow/a", "worker-b")
        assert (status, problem["code"], problem["holder"]) == (409, "lease_held", "worker-a")
        free_at = seconds(lease, "expires_at") + 3
        assert math.ceil(free_at - time.time()) == 3  # 2.6 s to go: rounded up
        assert headers["Retry-After"] == "3"

    async def test_the_next_owner_gets_the_next_fence(self, gw: InProcessGateway) -> None:
        await gw.acquire("run/a", "worker-a", ttl_s=0.3)
        await asyncio.sleep(0.35)
        status, _, taken = await gw.acquire("run/a", "worker-b")
        assert (status, taken["owner"], taken["fence"]) == (201, "worker-b", 2)
        await gw.send("DELETE", f"{API}/run/a", params={"owner": "worker-b", "fence": "2"})
        status, _, again = await gw.acquire("run/a", "worker-a")
        assert (status, again["fence"]) == (201, 3)

    async def test_a_retried_key_after_expiry_gets_a_new_lease(self, gw: InProcessGateway) -> None:
        """Handing back the dead lease would give the client a fence that cannot act."""
        await gw.acquire("run/a", "worker-a", ttl_s=0.3, key="k-1")
        await asyncio.sleep(0.35)
        status, _, lease = await gw.acquire("run/a", "worker-a", key="k-1")
        assert (status, lease["fence"], lease["state"]) == (201, 2, "held")

    async def test_a_takeover_of_an_unswept_lease_records_its_held_time(
        self, make_app: AppFactory, upstream: RecordingUpstream
    ) -> None:
        gw = await make_app(
            lease_policy(upstream.url), sweep_interval_s=60
        )  # the sweeper never marks it
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
    (
        "owner too long",
        "run/a",
        json.dumps({"owner": "w" * 129}).encode(),
        {},
        400,
        "invalid_request",
    ),
    ("owner bad char", "run/a", b'{"owner": "worker a"}', {}, 400, "invalid_request"),
    ("owner not a string", "run/a", b'{"owner": 7}', {}, 400, "invalid_request"),
    ("ttl over max", "run/a", b'{"owner": "w", "ttl_s": 5.001}', {}, 400, "invalid_request"),
    ("ttl zero", "run/a", b'{"owner": "w", "ttl_s": 0}', {}, 400, "invalid_request"),
    ("ttl negative", "run/a", b'{"owner": "w", "ttl_s": -1}', {}, 400, "invalid_request"),
    ("ttl a string", "run/a", b'{"owner": "w", "ttl_s": "3"}', {}, 400, "invalid_request"),
    ("ttl a bool", "run/a", b'{"owner": "w", "ttl_s": true}', {}, 400, "invalid_request"),
    ("ttl NaN", "run/a", b'{"owner": "w", "ttl_s": NaN}', {}, 400, "invalid_request"),
    (
        "ttl huge int",
        "run/a",
        b'{"owner": "w", "ttl_s": 1' + b"0" * 400 + b"}",
        {},
        400,
        "invalid_request",
    ),
    (
        "gw- key",
        "run/a",
        b'{"owner": "w"}',
        {"Idempotency-Key": "gw-1"},
        400,
        "invalid_idempotency_key",
    ),
    ("unknown parameter", "run/a?ttl_s=3", b'{"owner": "w"}', {}, 400, "invalid_request"),
    ("bad resource char", "run/a%20b", b'{"owner": "w"}', {}, 400, "invalid_resource"),
    ("empty segment", "run/a/", b'{"owner": "w"}', {}, 400, "invalid_resource"),
    ("resource too long", "run/" + "a" * 253, b'{"owner": "w"}', {}, 400, "invalid_resource"),
    ("no rule", "other/a", b'{"owner": "w"}', {}, 403, "resource_not_allowed"),
    ("external issuer", "ext/a", b'{"owner": "w"}', {}, 403, "resource_not_allowed"),
]


class TestBadRequests:
    """Every bad input is a problem+json 4xx, and nothing is acquired."""

    @pytest.mark.parametrize(
        "case, path, body, headers, status, code", BAD_ACQUIRES, ids=[c[0] for c in BAD_ACQUIRES]
    )
    async def test_bad_acquire(
        self,
        gw: InProcessGateway,
        case: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        status: int,
        code: str,
    ) -> None:
        got = await gw.send(
            "POST",
            f"{API}/{path}",
            data=body,
            headers={"Content-Type": "application/json", **headers},
        )
        assert (got[0], got[1]["Content-Type"].split(";")[0], got[2]["code"]) == (
            status,
            "application/problem+json",
            code,
        )
        assert await gw.store.list_leases(None, None, None, 10) == []

    @pytest.mark.parametrize("method", ["PUT", "DELETE", "GET"])
    async def test_an_unknown_resource_is_not_allowed(
        self, gw: InProcessGateway, method: str
    ) -> None:
        got = await gw.send(
            method,
            f"{API}/other/a",
            json={"owner": "w", "fence": 1},
            params={"owner": "w", "fence": "1"} if method == "DELETE" else {},
        )
        assert (got[0], got[2]["code"]) == (403, "resource_not_allowed")

    @pytest.mark.parametrize(
        ("method", "path", "kwargs", "expected"),
        [
            ("POST", f"{API}/run/c", {"data": "[" * 100_000}, (400, "invalid_request")),
            ("DELETE", f"{API}/run/c?force=maybe", {}, (400, "invalid_request")),
        ],
        ids=["deeply nested body", "force neither true nor false"],
    )
    async def test_refused(
        self, gw: InProcessGateway, method: str, path: str, kwargs: dict, expected: tuple
    ) -> None:
        async with gw.client.request(method, path, **kwargs) as r:
            assert (r.status, (await r.json())["code"]) == expected

    async def test_the_sweeper_owner_prefix_is_reserved(self, gw: InProcessGateway) -> None:
        async with gw.client.post(f"{API}/run/b", json={"owner": "gateway-sweeper:me"}) as r:
            assert (r.status, (await r.json())["code"]) == (400, "invalid_request")


class TestRenew:
    """Renew extends the current lease; anything but its live holder gets lease_lost."""

    async def test_renew_moves_the_expiry(self, gw: InProcessGateway) -> None:
        _, _, lease = await gw.acquire("run/a", ttl_s=2)
        await asyncio.sleep(0.1)
        status, _, renewed = await gw.send(
            "PUT", f"{API}/run/a", json={"owner": "worker-a", "fence": 1, "ttl_s": 3}
        )
        assert status == 200
        assert {k: renewed[k] for k in ("resource", "owner", "fence", "state", "acquired_at")} == {
            k: lease[k] for k in ("resource", "owner", "fence", "state", "acquired_at")
        }
        assert seconds(renewed, "renewed_at") >= seconds(lease, "acquired_at") + 0.1
        assert seconds(renewed, "expires_at") - seconds(renewed, "renewed_at") == pytest.approx(
            3, abs=0.002
        )
        # without ttl_s: the rule's ttl_s
        _, _, again = await gw.send("PUT", f"{API}/run/a", json={"owner": "worker-a", "fence": 1})
        assert seconds(again, "expires_at") - seconds(again, "renewed_at") == pytest.approx(
            1, abs=0.002
        )
        assert gw.metric("fence_gateway_lease_renewals_total", result="renewed") == 2

    @pytest.mark.parametrize(
        "body", [{"owner": "worker-b", "fence": 1}, {"owner": "worker-a", "fence": 2}]
    )
    async def test_not_the_holder_is_lease_lost(self, gw: InProcessGateway, body: dict) -> None:
        await gw.acquire("run/a")
        status, _, problem = await gw.send("PUT", f"{API}/run/a", json=body)
        assert (status, problem["code"]) == (409, "lease_lost")
        assert gw.metric("fence_gateway_lease_renewals_total", result="lost") == 1

    async def test_an_expired_or_released_lease_is_lost(self, gw: InProcessGateway) -> None:
        await gw.acquire("run/a", ttl_s=0.3)
        await asyncio.sleep(0.35)
        got = await gw.send("PUT", f"{API}/run/a", json={"owner": "worker-a", "fence": 1})
        assert (got[0], got[2]["code"]) == (409, "lease_lost")
        await gw.acquire("run/b")
        await gw.send("DELETE", f"{API}/run/b", params={"owner": "worker-a", "fence": "1"})
        got = await gw.send("PUT", f"{API}/run/b", json={"owner": "worker-a", "fence": 1})
        assert (got[0], got[2]["code"]) == (409, "lease_lost")

    @pytest.mark.parametrize(
        "body",
        [
            {"owner": "worker-a"},
            {"fence": 1},
            {"owner": "worker-a", "fence": 0},
            {"owner": "worker-a", "fence": -3},
            {"owner": "worker-a", "fence": "1"},
            {"owner": "worker-a", "fence": True},
            {"owner": "worker-a", "fence": 1.5},  # 1.0 is the integer 1 (JSON Schema)
            {"owner": "worker-a", "fence": 2**63},
            {"owner": "worker-a", "fence": 1, "ttl_s": 6},
            {"owner": "worker-a", "fence": 1, "extra": 1},
        ],
    )
    async def test_bad_renewals(self, gw: InProcessGateway, body: dict) -> None:
        await gw.acquire("run/a")
        got = await gw.send("PUT", f"{API}/run/a", json=body)
        assert (got[0], got[2]["code"]) == (400, "invalid_request")


class TestRelease:
    """Release by the holder, revoke by force; both free the resource for a new fence."""

    async def test_release_frees_the_resource(self, gw: InProcessGateway) -> None:
        await gw.acquire("run/a", ttl_s=3)
        status, _, body = await gw.send(
            "DELETE", f"{API}/run/a", params={"owner": "worker-a", "fence": "1"}
        )
        assert (status, body) == (204, None)
        _, _, lease = await gw.send("GET", f"{API}/run/a")
        assert (lease["state"], lease["fence"]) == ("released", 1)
        assert gw.metric("fence_gateway_lease_held_seconds_count") == 1
        # the holder releasing again is fine; the next owner gets a new fence at once
        again = await gw.send("DELETE", f"{API}/run/a", params={"owner": "worker-a", "fence": "1"})
        assert again[0] == 204
        assert (await gw.acquire("run/a", "worker-b"))[2]["fence"] == 2

    async def test_a_lease_that_expired_untaken_releases_fine(self, gw: InProcessGateway) -> None:
        await gw.acquire("run/a", ttl_s=0.3)
        await asyncio.sleep(0.35)
        got = await gw.send("DELETE", f"{API}/run/a", params={"owner": "worker-a", "fence": "1"})
        assert got[0] == 204

    @pytest.mark.parametrize(
        "query", [{"owner": "worker-b", "fence": "1"}, {"owner": "worker-a", "fence": "2"}]
    )
    async def test_anyone_else_is_lease_lost(self, gw: InProcessGateway, query: dict) -> None:
        await gw.acquire("run/a")
        got = await gw.send("DELETE", f"{API}/run/a", params=query)
        assert (got[0], got[2]["code"]) == (409, "lease_lost")
        assert (await gw.send("GET", f"{API}/run/a"))[2]["state"] == "held"

    async def test_a_taken_over_lease_is_lost_to_its_old_holder(self, gw: InProcessGateway) -> None:
        await gw.acquire("run/a", ttl_s=0.3)
        await asyncio.sleep(0.35)
        await gw.acquire("run/a", "worker-b")
        got = await gw.send("DELETE", f"{API}/run/a", params={"owner": "worker-a", "fence": "1"})
        assert (got[0], got[2]["code"]) == (409, "lease_lost")

    async def test_revoke(self, gw: InProcessGateway) -> None:
        await gw.acquire("run/a", ttl_s=3)
        got = await gw.send("DELETE", f"{API}/run/a", params={"force": "true"})
        assert got[0] == 204
        assert (await gw.send("GET", f"{API}/run/a"))[2]["state"] == "released"
        status, _, lease = await gw.acquire("run/a", "worker-b")
        assert (status, lease["fence"]) == (201, 2)
        assert (await gw.send("DELETE", f"{API}/never/leased", params={"force": "true"}))[0] == 403

    async def test_revoking_an_expired_lease_skips_the_lock_delay(
        self, gw: InProcessGateway
    ) -> None:
        await gw.acquire("slow/a", ttl_s=0.3)
        await asyncio.sleep(0.45)  # expired (and marked by the sweeper), lock delay 3 s
        assert (await gw.acquire("slow/a", "worker-b"))[0] == 409
        assert (await gw.send("DELETE", f"{API}/slow/a", params={"force": "true"}))[0] == 204
        status, _, lease = await gw.acquire("slow/a", "worker-b")
        assert (status, lease["fence"]) == (201, 2)

    @pytest.mark.parametrize(
        "query",
        [
            {},
            {"owner": "worker-a"},
            {"fence": "1"},
            {"owner": "worker-a", "fence": "01"},
            {"owner": "worker-a", "fence": "0"},
            {"owner": "worker-a", "fence": "x"},
            {"owner": "", "fence": "1"},
            {"force": "yes"},
            {"force": "true", "owner": "worker-a"},
            {"owner": "worker-a", "fence": "1", "ttl_s": "3"},
        ],
    )
    async def test_bad_releases(self, gw: InProcessGateway, query: dict) -> None:
        await gw.acquire("run/a")
        got = await gw.send("DELETE", f"{API}/run/a", params=query)
        assert (got[0], got[2]["code"]) == (400, "invalid_request")


class TestRead:
    """GET shows any lease record (expiry by the store's clock); lists page by resource."""

    async def test_get(self, gw: InProcessGateway) -> None:
        _, _, lease = await gw.acquire("run/a", ttl_s=0.3)
        status, _, shown = await gw.send("GET", f"{API}/run/a")
        assert (status, shown) == (200, lease)
        await asyncio.sleep(0.35)
        assert (await gw.send("GET", f"{API}/run/a"))[2] == lease | {"state": "expired"}
        got = await gw.send("GET", f"{API}/run/never")
        assert (got[0], got[2]["code"]) == (404, "not_found")
        got = await gw.send("GET", f"{API}/run/a", params={"x": "1"})
        assert (got[0], got[2]["code"]) == (400, "invalid_request")

    async def test_list_filters_and_pages(self, gw: InProcessGateway) -> None:
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
            ("run/a", "held"),
            ("run/b", "released"),
            ("run/c", "held"),
            ("run/d", "held"),
            ("run/e", "held"),
            ("slow/x", "expired"),
        ]
        assert everything["next_cursor"] is None
        seen, cursor = [], None
        for _ in range(5):
            body = await page(prefix="run/", limit="2", **({"cursor": cursor} if cursor else {}))
            seen += [x["resource"] for x in body["items"]]
            cursor = body["next_cursor"]
            if cursor is None:
                break
        assert seen == ["run/a", "run/b", "run/c", "run/d", "run/e"]
        assert [x["resource"] for x in (await page(state="held"))["items"]] == [
            "run/a",
            "run/c",
            "run/d",
            "run/e",
        ]
        assert [x["resource"] for x in (await page(state="released"))["items"]] == ["run/b"]
        assert [x["resource"] for x in (await page(state="expired"))["items"]] == ["slow/x"]

    @pytest.mark.parametrize(
        "query",
        [
            {"state": "gone"},
            {"limit": "0"},
            {"limit": "1001"},
            {"limit": "x"},
            {"cursor": "nope"},
            {"owner": "a"},
        ],
    )
    async def test_bad_list_parameters(self, gw: InProcessGateway, query: dict) -> None:
        got = await gw.send("GET", API, params=query)
        assert (got[0], got[2]["code"]) == (400, "invalid_request")


def metric_sample(gw: InProcessGateway, result: str) -> float:
    return gw.metric("fence_gateway_sweeper_cleanups_total", result=result)


class TestSweeperCleanup:
    """An expired lease with `on_expiry` gets its cleanup call, fenced, once, retried on failure."""

    async def test_the_cleanup_call_is_a_fenced_call_of_its_own(self, gw: InProcessGateway) -> None:
        _, _, lease = await gw.acquire("browser/acct-7", ttl_s=0.3)
        await gw.upstream.wait_received(1, method="DELETE", timeout=3)
        await wait_for(lambda: metric_sample(gw, "succeeded") == 1, what="the outcome")
        [sent] = gw.upstream.received(method="DELETE")
        assert sent.path_qs == "/api/sessions/acct-7?resource=browser%2Facct-7&fence=2"
        receipts = (await gw.send("GET", "/_gateway/v1/receipts"))[2]["items"]
        [receipt] = receipts
        assert {
            k: sent.headers.get(k)
            for k in (
                "Host",
                "Idempotency-Key",
                "X-Lease-Resource",
                "X-Fence-Token",
                "X-Receipt-Id",
                "X-Tool-Token",
            )
        } == {
            "Host": f"127.0.0.1:{gw.upstream.port}",
            "Idempotency-Key": "gw-sweep-2",
            "X-Lease-Resource": "browser/acct-7",
            "X-Fence-Token": "2",
            "X-Receipt-Id": receipt["id"],
            "X-Tool-Token": "secret",
        }
        assert {
            k: receipt[k]
            for k in (
                "resource",
                "fence",
                "owner",
                "client",
                "upstream",
                "method",
                "path",
                "idempotency_key",
                "attempt",
                "status",
                "http_status",
                "instance",
            )
        } == {
            "resource": "browser/acct-7",
            "fence": 2,
            "owner": "gateway-sweeper:test-1",
            "client": None,
            "upstream": "tool",
            "method": "DELETE",
            "path": "/sessions/acct-7?resource=browser%2Facct-7&fence=2",
            "idempotency_key": "gw-sweep-2",
            "attempt": 1,
            "status": "succeeded",
            "http_status": 200,
            "instance": "test-1",
        }
        # the sweeper released its lease: the resource is free for a new owner at once
        await wait_for(lambda: not gw.app[appkeys.IN_FLIGHT], what="the cleanup to end")
        _, _, swept = await gw.send("GET", f"{API}/browser/acct-7")
        assert (swept["owner"], swept["fence"]) == ("gateway-sweeper:test-1", 2)
        status, _, problem = await gw.send(
            "POST",
            "/tool/click",
            headers={"X-Lease-Resource": "browser/acct-7", "X-Fence-Token": str(lease["fence"])},
        )
        assert (status, problem["code"]) == (409, "stale_fence")
        assert await gw.store.list_cleanups() == []
        await asyncio.sleep(0.3)  # and it is not repeated
        assert len(gw.upstream.received(method="DELETE")) == 1

    async def test_a_failed_cleanup_is_retried_at_a_later_sweep(self, gw: InProcessGateway) -> None:
        answers = iter([Behavior(status=500), Behavior(status=503), Behavior(status=201)])
        gw.upstream.script("/api/sessions/acct-8", lambda _rec: next(answers))
        await gw.acquire("browser/acct-8", ttl_s=0.3)
        await gw.upstream.wait_received(3, method="DELETE", timeout=5)
        fences = [r.fence for r in gw.upstream.received(method="DELETE")]
        assert fences == [2, 3, 4]  # each attempt under a new sweeper lease, a new key
        await wait_for(lambda: metric_sample(gw, "succeeded") == 1, what="the success")
        assert (metric_sample(gw, "failed"), metric_sample(gw, "unknown")) == (2, 0)
        receipts = (await gw.send("GET", "/_gateway/v1/receipts"))[2]["items"]
        assert [
            (r["fence"], r["idempotency_key"], r["status"], r["http_status"]) for r in receipts
        ] == [
            (2, "gw-sweep-2", "failed", 500),
            (3, "gw-sweep-3", "failed", 503),
            (4, "gw-sweep-4", "succeeded", 201),
        ]
        assert await gw.store.list_cleanups() == []

    async def test_an_unknown_outcome_waits_for_reconciliation(
        self, make_app: AppFactory, upstream: RecordingUpstream
    ) -> None:
        gw = await make_app(lease_policy(upstream.url, timeout_s=0.3), reconcile_grace_s=0)
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
        resolved = await gw.store.resolve(
            receipt["id"], "not_applied", "operator:test", None, ReconcileWaits({}, 0.3)
        )
        assert resolved.status == "reconciled"
        await gw.upstream.wait_received(2, method="DELETE", timeout=4)
        await wait_for(lambda: metric_sample(gw, "succeeded") == 1, what="the retry")
        assert [r.fence for r in gw.upstream.received(method="DELETE")] == [2, 3]

    async def test_an_applied_unknown_cleanup_is_not_repeated(
        self, make_app: AppFactory, upstream: RecordingUpstream
    ) -> None:
        gw = await make_app(lease_policy(upstream.url, timeout_s=0.3), reconcile_grace_s=0)
        gw.upstream.script("/api/sessions/acct-9", Behavior(action="close"))
        await gw.acquire("browser/acct-9", ttl_s=0.3)
        await wait_for(lambda: metric_sample(gw, "unknown") == 1, what="the unknown outcome")
        [receipt] = (await gw.send("GET", "/_gateway/v1/reconciliation"))[2]["items"]
        await asyncio.sleep(0.3)
        await gw.store.resolve(
            receipt["id"], "applied", "operator:test", None, ReconcileWaits({}, 0.3)
        )
        for _ in range(40):
            if not await gw.store.list_cleanups():
                break
            await asyncio.sleep(0.1)
        assert await gw.store.list_cleanups() == []
        assert len(gw.upstream.received(method="DELETE")) == 1

    async def test_rules_without_on_expiry_owe_nothing(self, gw: InProcessGateway) -> None:
        await gw.acquire("run/a", ttl_s=0.3)
        await asyncio.sleep(0.5)
        assert (await gw.send("GET", f"{API}/run/a"))[2]["state"] == "expired"
        assert await gw.store.list_cleanups() == []
        assert gw.upstream.requests == []


class TestCleanerRules:
    """Which expired leases owe a cleanup."""

    async def test_owed_after(self, gw: InProcessGateway) -> None:
        cleaner = Cleaner(gw.app)
        assert cleaner.owed_after("browser/a", "worker-a") == 0
        assert cleaner.owed_after("browser/a", "gateway-sweeper:x") is None
        assert cleaner.owed_after("run/a", "worker-a") is None
        assert cleaner.owed_after("nothing/a", "worker-a") is None
