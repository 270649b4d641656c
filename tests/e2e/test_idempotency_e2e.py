"""docs/contract.md §4 end to end: every row of the idempotency table, against the gateway as a
subprocess and a real upstream that counts what reaches it.

The upstream's count is the point of every test here: a replay, a refusal or an in-flight
answer must never reach the tool, and a "new attempt" must reach it once more with the same
key. Reconciled rows use `GATEWAY_RECONCILE_GRACE_S=0` and an upstream `timeout_s` of 0.5 s,
so a lost outcome becomes reconcilable half a second after it was forwarded.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from tests.harness import (
    Behavior,
    CallResult,
    GatewayFactory,
    GatewayProcess,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    free_port,
    make_policy,
    pick,
    problem,
    write_policy,
)

TIMEOUT_S = 0.5  # the upstream's timeout_s: also how long until a lost outcome is reconcilable
RECONCILE_ENV = {"GATEWAY_RECONCILE_GRACE_S": "0"}
RULES = [
    {"match": "idem/*", "idempotency": {"replay_max_bytes": 1024}},
    {"match": "req/*", "idempotency": {"key": "require"}},
    {"match": "rnd/*", "idempotency": {"key": "random"}},
]


async def start(gateway_factory: GatewayFactory, upstream_url: str) -> GatewayProcess:
    policy = make_policy(upstream_url, RULES, timeout_s=TIMEOUT_S)
    return await gateway_factory(policy, extra_env=RECONCILE_ENV)


async def post(
    session: aiohttp.ClientSession,
    gateway: GatewayProcess,
    path: str,
    *,
    resource: str = "idem/r1",
    fence: int = 1,
    key: str | None = None,
    body: bytes = b'{"amount": 10}',
    label: Any = None,
) -> CallResult:
    headers = fenced_headers(resource, fence)
    if key is not None:
        headers["Idempotency-Key"] = key
    return await call(
        session, "POST", f"{gateway.url}/tool{path}", data=body, headers=headers, label=label
    )


async def resolve(
    session: aiohttp.ClientSession, gateway: GatewayProcess, receipt_id: str, outcome: str
) -> dict[str, Any]:
    url = f"{gateway.url}/_gateway/v1/receipts/{receipt_id}/resolve"
    body = {"outcome": outcome, "source": "operator:test"}
    async with session.post(url, json=body) as resp:
        answer = await resp.json(content_type=None)
        assert resp.status == 200, answer
        return answer


async def receipts_of(
    session: aiohttp.ClientSession, gateway: GatewayProcess, **filters: Any
) -> list[dict[str, Any]]:
    return await fetch_receipts(session, gateway.url, **filters)


def replay_view(result: CallResult) -> dict[str, Any]:
    """What a client learns from an answer: status, the headers that matter, the body."""
    assert result.headers is not None, result.error
    return {
        "status": result.status,
        "replayed": result.headers.get("Idempotent-Replayed"),
        "receipt": result.headers.get("X-Receipt-Id"),
        "key": result.headers.get("Idempotency-Key"),
        "fence": result.headers.get("X-Fence-Token"),
        "tool": result.headers.get("X-Tool"),
        "body": result.body,
    }


RECEIPT_FIELDS = ("status", "attempt", "http_status", "reject_code", "idempotency_key")


class TestTheTable:
    """Each row of the §4 table, with what reached the tool."""

    async def test_a_different_fingerprint_is_refused_whatever_the_state(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream.url)
        gate = asyncio.Event()
        upstream.script("/api/pay", Behavior(gate=gate))

        first = asyncio.create_task(post(session, gateway, "/pay", key="k-1"))
        await upstream.wait_received(1)
        pending_receipt = upstream.requests[0].headers["X-Receipt-Id"]
        while_pending = await post(session, gateway, "/pay", key="k-1", body=b'{"amount": 99}')
        same_while_pending = await post(session, gateway, "/pay", key="k-1")
        gate.set()
        assert (await first).status == 200
        after = await post(session, gateway, "/pay", key="k-1", body=b'{"amount": 99}')
        other_path = await post(session, gateway, "/refund", key="k-1")

        reused = {"status": 422, "code": "idempotency_key_reused"}
        fields = ("status", "code", "receipt_id")
        assert [pick(problem(r), fields) for r in (while_pending, after, other_path)] == [
            {**reused, "receipt_id": "<missing>"}
        ] * 3
        in_flight = problem(same_while_pending)
        assert pick(in_flight, fields) == {
            "status": 409,
            "code": "idempotency_in_flight",
            "receipt_id": pending_receipt,
        }
        assert same_while_pending.headers["Retry-After"] == "1"
        assert len(upstream.requests) == 1

        receipts = await receipts_of(session, gateway, idempotency_key="k-1")
        assert [pick(r, RECEIPT_FIELDS) for r in receipts] == [
            {
                "status": "succeeded",
                "attempt": 1,
                "http_status": 200,
                "reject_code": None,
                "idempotency_key": "k-1",
            },
            *[
                {
                    "status": "rejected",
                    "attempt": None,
                    "http_status": status,
                    "reject_code": code,
                    "idempotency_key": "k-1",
                }
                for status, code in (
                    (422, "idempotency_key_reused"),
                    (409, "idempotency_in_flight"),
                    (422, "idempotency_key_reused"),
                    (422, "idempotency_key_reused"),
                )
            ],
        ]

    async def test_a_completed_answer_is_replayed_with_its_receipt(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream.url)
        upstream.script(
            "/api/pay",
            Behavior(status=201, body=b'{"paid": 10}', headers={"X-Tool": "ledger-7"}),
        )
        upstream.script("/api/bad", Behavior(status=400, body=b'{"error": "no funds"}'))

        results = {}
        for name, path, key in (("created", "/pay", "k-pay"), ("refused", "/bad", "k-bad")):
            original = await post(session, gateway, path, key=key)
            again = await post(session, gateway, path, key=key)
            results[name] = (replay_view(original), replay_view(again))
        # No Idempotency-Key: the derived key makes an identical call the same operation.
        derived = await post(session, gateway, "/pay", body=b'{"amount": 5}')
        derived_again = await post(session, gateway, "/pay", body=b'{"amount": 5}')

        for name, status, body, tool in (
            ("created", 201, b'{"paid": 10}', "ledger-7"),
            ("refused", 400, b'{"error": "no funds"}', None),
        ):
            original, again = results[name]
            assert original == {
                "status": status,
                "replayed": None,
                "receipt": original["receipt"],
                "key": f"k-{'pay' if name == 'created' else 'bad'}",
                "fence": "1",
                "tool": tool,
                "body": body,
            }
            assert again == {**original, "replayed": "true"}
        assert derived.headers["Idempotency-Key"].startswith("gw-")
        assert replay_view(derived_again) == {**replay_view(derived), "replayed": "true"}
        assert derived_again.headers["Content-Type"] == derived.headers["Content-Type"]
        assert [(r.path, r.headers["Idempotency-Key"]) for r in upstream.requests] == [
            ("/api/pay", "k-pay"),
            ("/api/bad", "k-bad"),
            ("/api/pay", derived.headers["Idempotency-Key"]),
        ]
        # A replay creates no receipt.
        receipts = await receipts_of(session, gateway)
        assert [r["status"] for r in receipts] == ["succeeded", "failed", "succeeded"]

    async def test_an_answer_not_kept_is_already_completed(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream.url)
        big = b"x" * 2000  # over the rule's replay_max_bytes of 1024
        upstream.script("/api/big", Behavior(body=big, headers={"Content-Type": "text/plain"}))
        upstream.script("/api/broken", Behavior(body=b"y" * 100, action="partial"))

        first_big = await post(session, gateway, "/big", key="k-big")
        assert (first_big.status, first_big.body) == (200, big)  # passed on whole, not kept
        first_broken = await post(session, gateway, "/broken", key="k-broken")
        assert first_broken.status is None or first_broken.body != b"y" * 100

        refusals = {}
        for key in ("k-big", "k-broken"):
            receipt = (await receipts_of(session, gateway, idempotency_key=key))[0]
            again = problem(await post(session, gateway, f"/{key[2:]}", key=key))
            refusals[key] = (pick(receipt, ("status", "error")), again)
        assert {
            k: (r, pick(p, ("status", "code", "receipt_id"))) for k, (r, p) in refusals.items()
        } == {
            "k-big": (
                {"status": "succeeded", "error": None},
                {
                    "status": 409,
                    "code": "already_completed",
                    "receipt_id": first_big.headers["X-Receipt-Id"],
                },
            ),
            "k-broken": (
                {"status": "succeeded", "error": "response_incomplete"},
                {
                    "status": 409,
                    "code": "already_completed",
                    "receipt_id": upstream.requests[1].headers["X-Receipt-Id"],
                },
            ),
        }
        assert len(upstream.requests) == 2

    async def test_a_failure_with_a_retry_status_is_a_new_attempt(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream.url)
        retry_statuses = (408, 425, 429, 503)
        answered: dict[str, int] = {}

        def first_fails(rec) -> Behavior:
            key = rec.headers["Idempotency-Key"]
            answered[key] = answered.get(key, 0) + 1
            status = int(key.removeprefix("k-")) if answered[key] == 1 else 200
            return Behavior(status=status, body=f'{{"status": {status}}}'.encode())

        upstream.default = first_fails
        seen = {}
        for status in retry_statuses:
            key = f"k-{status}"
            first = await post(session, gateway, "/pay", key=key)
            second = await post(session, gateway, "/pay", key=key)
            receipts = await receipts_of(session, gateway, idempotency_key=key)
            seen[status] = (
                first.status,
                second.status,
                second.headers.get("Idempotent-Replayed"),
                [pick(r, ("status", "attempt", "http_status")) for r in receipts],
            )
        assert seen == {
            status: (
                status,
                200,
                None,
                [
                    {"status": "failed", "attempt": 1, "http_status": status},
                    {"status": "succeeded", "attempt": 2, "http_status": 200},
                ],
            )
            for status in retry_statuses
        }
        # Each key reached the tool twice, the same key both times.
        assert answered == {f"k-{s}": 2 for s in retry_statuses}

    async def test_an_unknown_outcome_is_refused_until_reconciled(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream.url)
        upstream.script("/api/drop", Behavior(action="close"))
        upstream.script("/api/slow", Behavior(delay=TIMEOUT_S + 1))

        dropped = await post(session, gateway, "/drop", key="k-drop")
        timed_out = await post(session, gateway, "/slow", key="k-slow")
        answers = {}
        for name, first, path, key in (
            ("drop", dropped, "/drop", "k-drop"),
            ("slow", timed_out, "/slow", "k-slow"),
        ):
            retry = await post(session, gateway, path, key=key)
            answers[name] = (
                pick(problem(first), ("status", "code")),
                pick(problem(retry), ("status", "code", "receipt_id")),
                first.headers["X-Receipt-Id"],
            )
        assert answers == {
            "drop": (
                {"status": 502, "code": "upstream_outcome_unknown"},
                {"status": 409, "code": "outcome_unknown", "receipt_id": answers["drop"][2]},
                answers["drop"][2],
            ),
            "slow": (
                {"status": 504, "code": "upstream_timeout"},
                {"status": 409, "code": "outcome_unknown", "receipt_id": answers["slow"][2]},
                answers["slow"][2],
            ),
        }
        assert [r.path for r in upstream.requests] == ["/api/drop", "/api/slow"]

    async def test_reconciled_applied_or_compensated_is_already_completed(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream.url)
        upstream.script("/api/drop", Behavior(action="close"))
        lost = {}
        for outcome in ("applied", "compensated"):
            result = await post(session, gateway, "/drop", key=f"k-{outcome}")
            lost[outcome] = result.headers["X-Receipt-Id"]
        await asyncio.sleep(TIMEOUT_S + 0.1)  # past forwarded_at + timeout_s + grace (0)
        for outcome, receipt_id in lost.items():
            assert (await resolve(session, gateway, receipt_id, outcome))["status"] == (
                "reconciled"
            )
        retries = {
            outcome: pick(
                problem(await post(session, gateway, "/drop", key=f"k-{outcome}")),
                ("status", "code", "receipt_id"),
            )
            for outcome in lost
        }
        assert retries == {
            outcome: {"status": 409, "code": "already_completed", "receipt_id": receipt_id}
            for outcome, receipt_id in lost.items()
        }
        assert len(upstream.requests) == 2

    async def test_reconciled_not_applied_is_a_new_attempt(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream.url)
        tries = []

        def drop_first(rec) -> Behavior:
            tries.append(rec.headers["Idempotency-Key"])
            return Behavior(action="close") if len(tries) == 1 else Behavior(status=201)

        upstream.default = drop_first
        lost = await post(session, gateway, "/pay", key="k-1")
        assert lost.status == 502
        await asyncio.sleep(TIMEOUT_S + 0.1)
        await resolve(session, gateway, lost.headers["X-Receipt-Id"], "not_applied")
        retry = await post(session, gateway, "/pay", key="k-1")

        assert (retry.status, retry.headers.get("Idempotent-Replayed")) == (201, None)
        assert tries == ["k-1", "k-1"]
        receipts = await receipts_of(session, gateway, idempotency_key="k-1")
        assert [pick(r, ("status", "attempt", "id")) for r in receipts] == [
            {"status": "reconciled", "attempt": 1, "id": lost.headers["X-Receipt-Id"]},
            {"status": "succeeded", "attempt": 2, "id": retry.headers["X-Receipt-Id"]},
        ]

    async def test_not_sent_is_a_new_attempt(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        # The tool is down at first: nothing listens on its port.
        policy = make_policy(f"http://127.0.0.1:{free_port()}/api", RULES, timeout_s=TIMEOUT_S)
        gateway = await gateway_factory(policy, extra_env=RECONCILE_ENV)
        unreachable = [await post(session, gateway, "/pay", key="k-1") for _ in range(2)]
        assert [pick(problem(r), ("status", "code")) for r in unreachable] == [
            {"status": 502, "code": "upstream_unreachable"}
        ] * 2
        # The tool comes back (here: the policy points at it); the key's state survives.
        write_policy(gateway.policy_path, make_policy(upstream.url, RULES, timeout_s=TIMEOUT_S))
        await gateway.restart()
        retry = await post(session, gateway, "/pay", key="k-1")

        assert retry.status == 200
        assert [r.headers["Idempotency-Key"] for r in upstream.requests] == ["k-1"]
        receipts = await receipts_of(session, gateway, idempotency_key="k-1")
        assert [pick(r, ("status", "attempt", "error")) for r in receipts] == [
            {"status": "not_sent", "attempt": 1, "error": "upstream_unreachable"},
            {"status": "not_sent", "attempt": 2, "error": "upstream_unreachable"},
            {"status": "succeeded", "attempt": 3, "error": None},
        ]

    async def test_key_modes_require_and_random(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream.url)
        missing = await post(session, gateway, "/pay", resource="req/r1")
        randoms = [await post(session, gateway, "/pay", resource="rnd/r1") for _ in range(2)]

        assert pick(problem(missing), ("status", "code")) == {
            "status": 428,
            "code": "missing_idempotency_key",
        }
        keys = [r.headers["Idempotency-Key"] for r in randoms]
        assert [r.status for r in randoms] == [200, 200]
        assert keys[0] != keys[1] and all(k.startswith("gw-") for k in keys)
        assert [r.headers["Idempotency-Key"] for r in upstream.requests] == keys


class TestConcurrentRetries:
    """Simultaneous identical calls are one operation at the tool."""

    async def test_twenty_simultaneous_calls_with_one_key_reach_the_tool_once(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream.url)
        upstream.default = Behavior(status=201, body=b'{"done": 1}', delay=0.2)

        async def burst(resource: str, key: str | None) -> list[CallResult]:
            return list(
                await asyncio.gather(
                    *(
                        post(session, gateway, "/pay", resource=resource, key=key, label=i)
                        for i in range(20)
                    )
                )
            )

        outcomes = {}
        for resource, key in (("idem/client-key", "k-burst"), ("idem/derived", None)):
            results = await burst(resource, key)
            kinds = []
            for r in results:
                if r.status == 201 and r.headers.get("Idempotent-Replayed") is None:
                    kinds.append("forwarded")
                elif r.status == 201:
                    kinds.append("replayed")
                else:
                    body = problem(r)
                    assert (body["status"], body["code"]) == (409, "idempotency_in_flight"), body
                    kinds.append("in_flight")
            forwarded = [r for r in results if r.status == 201]
            originals = {r.headers["X-Receipt-Id"] for r in forwarded}
            in_flight_points_at = {problem(r)["receipt_id"] for r in results if r.status == 409}
            outcomes[resource] = {
                "forwarded": kinds.count("forwarded"),
                "others": kinds.count("replayed") + kinds.count("in_flight"),
                "one receipt": len(originals | in_flight_points_at) == 1,
                "tool calls": len([r for r in upstream.requests if r.resource == resource]),
            }
        assert outcomes == {
            resource: {"forwarded": 1, "others": 19, "one receipt": True, "tool calls": 1}
            for resource in ("idem/client-key", "idem/derived")
        }
        assert len({r.headers["Idempotency-Key"] for r in upstream.requests}) == 2


class TestKeysAcrossOwners:
    """The fence check comes first; a key is learned, never replayed to a stale owner."""

    async def test_a_new_owner_learns_the_outcome_and_a_stale_owner_is_fenced(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream.url)
        upstream.default = Behavior(status=201, body=b'{"charge": "ch_1"}')

        predecessor = await post(session, gateway, "/charge", fence=7, key="k-charge")
        successor = await post(session, gateway, "/charge", fence=8, key="k-charge")
        stale = await post(session, gateway, "/charge", fence=7, key="k-charge")
        stale_other_key = await post(session, gateway, "/charge", fence=7, key="k-other")

        assert replay_view(successor) == {
            **replay_view(predecessor),
            "replayed": "true",
            "fence": "8",
        }
        assert successor.headers["X-Receipt-Id"] == predecessor.headers["X-Receipt-Id"]
        for refused in (stale, stale_other_key):
            assert refused.headers.get("Idempotent-Replayed") is None
            assert pick(problem(refused), ("status", "code", "fence")) == {
                "status": 409,
                "code": "stale_fence",
                "fence": 7,
            }
        assert len(upstream.requests) == 1
        # The replay advanced the fence: the predecessor's receipt is the only one forwarded.
        receipts = await receipts_of(session, gateway, resource="idem/r1")
        assert [pick(r, ("fence", "status", "reject_code")) for r in receipts] == [
            {"fence": 7, "status": "succeeded", "reject_code": None},
            {"fence": 7, "status": "rejected", "reject_code": "stale_fence"},
            {"fence": 7, "status": "rejected", "reject_code": "stale_fence"},
        ]

    async def test_a_new_owner_must_reconcile_its_predecessors_lost_call(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream.url)
        upstream.default = Behavior(action="close")
        lost = await post(session, gateway, "/charge", fence=1, key="k-charge")
        successor = await post(session, gateway, "/charge", fence=2, key="k-charge")

        assert pick(problem(successor), ("status", "code", "receipt_id")) == {
            "status": 409,
            "code": "outcome_unknown",
            "receipt_id": lost.headers["X-Receipt-Id"],
        }
        assert len(upstream.requests) == 1
        assert json.loads(successor.body)["fence"] == 2


class TestRetention:
    """§4: a key is kept `retention_s` after its receipt completed, then forgotten."""

    async def test_a_key_past_retention_is_a_new_attempt_counted_after_the_old_ones(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        rules = [{"match": "idem/*", "idempotency": {"retention_s": 0.3}}]
        gateway = await gateway_factory(
            make_policy(upstream.url, rules, timeout_s=TIMEOUT_S), sweep_interval_s=0.1
        )
        first = await post(session, gateway, "/pay", key="k-1")
        replayed = await post(session, gateway, "/pay", key="k-1")
        await asyncio.sleep(0.3 + 0.1 * 3)  # retention, then a sweep or two prune the key
        after = await post(session, gateway, "/pay", key="k-1")

        assert [first.status, replayed.status, after.status] == [200, 200, 200]
        assert [r.headers.get("Idempotent-Replayed") for r in (first, replayed, after)] == [
            None,
            "true",
            None,
        ]
        assert [r.headers["Idempotency-Key"] for r in upstream.requests] == ["k-1", "k-1"]
        receipts = await receipts_of(session, gateway, idempotency_key="k-1")
        # attempt = 1 + the earlier non-rejected receipts with the key, kept or not.
        assert [pick(r, ("status", "attempt")) for r in receipts] == [
            {"status": "succeeded", "attempt": 1},
            {"status": "succeeded", "attempt": 2},
        ]
