"""Raising fences through the API (docs/contract.md §18) on the real app: admin only, never
lowering, a holder fenced out at once, globs that cover resources first seen later, and every
bad input a problem+json `400` that changes nothing."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from gateway.core.grammar import MAX_FENCE
from tests.harness import AppFactory, InProcessGateway, RecordingUpstream, make_policy

KEYS = {"agent": "k-agent", "recon": "k-recon", "root": "k-root"}


def _client(name: str, role: str, scope: str) -> str:
    digest = hashlib.sha256(KEYS[name].encode()).hexdigest()
    return f'  - {{name: {name}, key_sha256: "{digest}", roles: [{role}]{scope}}}\n'


CLIENTS = (
    "clients:\n"
    + _client("agent", "agent", ', resources: ["**"]')
    + _client("recon", "reconciler", "")
    + _client("root", "admin", "")
)


def policy(upstream: RecordingUpstream) -> dict[str, Any]:
    return make_policy(
        upstream.url,
        [
            {"match": "g/*", "lease": {"issuer": "gateway", "ttl_s": 30}},
            {"match": "ext/**", "lease": {"issuer": "external"}},
        ],
    )


def auth(who: str, proxied: bool = False) -> dict[str, str]:
    return {"Proxy-Authorization" if proxied else "Authorization": f"Bearer {KEYS[who]}"}


@pytest.fixture
async def gw(make_app: AppFactory, upstream: RecordingUpstream) -> InProcessGateway:
    return await make_app(policy(upstream), clients=CLIENTS, sweep_interval_s=1)


async def put(gw: InProcessGateway, resource: str, body: Any, who: str = "root"):
    return await gw.send("PUT", f"/_gateway/v1/fences/{resource}", json=body, headers=auth(who))


async def raise_glob(gw: InProcessGateway, body: Any, who: str = "root", **kw: Any):
    return await gw.send("POST", "/_gateway/v1/fences/raise", json=body, headers=auth(who), **kw)


async def fenced_call(gw: InProcessGateway, resource: str, fence: int) -> tuple[int, Any]:
    status, _headers, body = await gw.send(
        "POST",
        "/tool/act",
        data=f"{resource}-{fence}".encode(),
        headers={
            **auth("agent", proxied=True),
            "X-Lease-Resource": resource,
            "X-Fence-Token": str(fence),
        },
    )
    return status, (body or {}).get("code") if status >= 400 else None


class TestRaiseOne:
    async def test_raises_never_lowers_and_fences_out_the_holder(self, gw) -> None:
        status, _h, lease = await gw.send(
            "POST", "/_gateway/v1/leases/g/1", json={"owner": "a"}, headers=auth("agent")
        )
        assert (status, lease["fence"]) == (201, 1)
        assert await fenced_call(gw, "g/1", 1) == (200, None)
        status, _h, body = await put(gw, "g/1", {"at_least": 40})
        assert (status, body) == (200, {"resource": "g/1", "highest_fence": 40})
        status, _h, body = await put(gw, "g/1", {"at_least": 5})
        assert (status, body["highest_fence"]) == (200, 40)  # never lowered
        assert await fenced_call(gw, "g/1", 1) == (409, "stale_fence")
        status, _h, _b = await gw.send(
            "DELETE", "/_gateway/v1/leases/g/1?force=true", headers=auth("root")
        )
        assert status == 204
        status, _h, lease = await gw.send(
            "POST", "/_gateway/v1/leases/g/1", json={"owner": "b"}, headers=auth("agent")
        )
        assert lease["fence"] == 41

    async def test_a_resource_raised_to_the_end_of_the_range_issues_no_more_leases(
        self, gw
    ) -> None:
        status, _h, body = await put(gw, "g/end", {"at_least": MAX_FENCE})
        assert (status, body["highest_fence"]) == (200, MAX_FENCE)
        status, _h, problem = await gw.send(
            "POST", "/_gateway/v1/leases/g/end", json={"owner": "a"}, headers=auth("agent")
        )
        assert (status, problem["code"]) == (403, "resource_not_allowed")
        assert "used up" in problem["detail"]

    async def test_only_an_admin_may_raise(self, gw) -> None:
        for who in ("agent", "recon"):
            status, _h, body = await put(gw, "ext/a", {"at_least": 9}, who=who)
            assert (status, body["code"]) == (403, "forbidden")
            status, _h, body = await raise_glob(gw, {"match": "**", "at_least": 9}, who=who)
            assert (status, body["code"]) == (403, "forbidden")
        status, _h, body = await gw.send("PUT", "/_gateway/v1/fences/ext/a", json={"at_least": 9})
        assert (status, body["code"]) == (401, "unauthenticated")
        assert await fenced_call(gw, "ext/a", 1) == (200, None)  # nothing was raised

    @pytest.mark.parametrize(
        ("path", "body", "code"),
        [
            ("ext/a", {"at_least": 0}, "invalid_request"),
            ("ext/a", {"at_least": -3}, "invalid_request"),
            ("ext/a", {"at_least": 2**63}, "invalid_request"),
            ("ext/a", {"at_least": "5"}, "invalid_request"),
            ("ext/a", {"at_least": True}, "invalid_request"),
            ("ext/a", {"at_least": 5.5}, "invalid_request"),
            ("ext/a", {}, "invalid_request"),
            ("ext/a", {"at_least": 5, "extra": 1}, "invalid_request"),
            ("ext/a", [5], "invalid_request"),
            ("ext/a b", {"at_least": 5}, "invalid_resource"),
            ("ext//a", {"at_least": 5}, "invalid_resource"),
        ],
    )
    async def test_bad_input_is_a_problem_and_changes_nothing(
        self, gw, path: str, body: Any, code: str
    ) -> None:
        status, headers, problem = await put(gw, path, body)
        assert (status, problem["code"]) == (400, code)
        assert headers["Content-Type"].startswith("application/problem+json")
        assert await fenced_call(gw, "ext/a", 1) == (200, None)


class TestRaiseGlob:
    async def test_covers_known_resources_and_those_first_seen_later(self, gw) -> None:
        assert await fenced_call(gw, "ext/a/1", 3) == (200, None)
        assert await fenced_call(gw, "ext/b", 3) == (200, None)
        status, _h, body = await raise_glob(gw, {"match": "ext/a/**", "at_least": 100})
        assert (status, body) == (200, {"match": "ext/a/**", "at_least": 100, "known_resources": 1})
        assert await fenced_call(gw, "ext/a/1", 99) == (409, "stale_fence")
        assert await fenced_call(gw, "ext/a/new/x", 99) == (409, "stale_fence")
        assert await fenced_call(gw, "ext/a/new/x", 100) == (200, None)
        assert await fenced_call(gw, "ext/b", 4) == (200, None)  # not covered

    @pytest.mark.parametrize(
        "body",
        [
            {"match": "", "at_least": 5},
            {"match": "a//b", "at_least": 5},
            {"match": "a/../b", "at_least": 5},
            {"match": "a b", "at_least": 5},
            {"match": "*" * 257, "at_least": 5},
            {"match": "ext/**", "at_least": 0},
            {"match": "ext/**"},
            {"at_least": 5},
            {"match": 5, "at_least": 5},
        ],
    )
    async def test_bad_input_is_a_problem_and_changes_nothing(self, gw, body: Any) -> None:
        status, _h, problem = await raise_glob(gw, body)
        assert (status, problem["code"]) == (400, "invalid_request")
        assert await fenced_call(gw, "ext/z", 1) == (200, None)

    async def test_not_json_and_unknown_parameters(self, gw) -> None:
        status, _h, problem = await gw.send(
            "POST", "/_gateway/v1/fences/raise", data=b"{", headers=auth("root")
        )
        assert (status, problem["code"]) == (400, "invalid_request")
        status, _h, problem = await gw.send(
            "POST",
            "/_gateway/v1/fences/raise?x=1",
            json={"match": "**", "at_least": 5},
            headers=auth("root"),
        )
        assert (status, problem["code"]) == (400, "invalid_request")
        status, headers, problem = await gw.send(
            "GET", "/_gateway/v1/fences/raise", headers=auth("root")
        )
        assert (status, headers["Allow"]) == (405, "POST")
