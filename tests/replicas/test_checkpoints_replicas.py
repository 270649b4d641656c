"""Checkpoints and the run view on two gateway processes sharing one PostgreSQL database
(docs/contract.md §14, §17): the fence check of a checkpoint is the database's, under the
resource's lock, whichever replica the writer and its successor talk to."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.harness import GatewayProcess, RecordingUpstream, call, fenced_headers, make_policy
from tests.replicas.conftest import Replicas

RESOURCE = "task/r1"


async def api(
    session: aiohttp.ClientSession, gateway: GatewayProcess, method: str, path: str, **kwargs: Any
) -> tuple[int, Any]:
    async with session.request(method, f"{gateway.url}/_gateway/v1{path}", **kwargs) as resp:
        return resp.status, await resp.json() if resp.status != 204 else None


async def put_checkpoint(
    session: aiohttp.ClientSession, gateway: GatewayProcess, fence: int, step: str
) -> tuple[int, Any]:
    return await api(
        session,
        gateway,
        "PUT",
        f"/checkpoints/{RESOURCE}",
        headers={"X-Fence-Token": str(fence)},
        json={"step": step, "state": {"step": step}},
    )


async def test_a_taken_over_writer_is_refused_through_any_replica(
    upstream: RecordingUpstream, replicas: Replicas, session: aiohttp.ClientSession
) -> None:
    one, two = await replicas(
        make_policy(upstream.url, [{"match": "task/*", "lease": {"issuer": "gateway"}}])
    )
    status, lease_a = await api(
        session, one, "POST", f"/leases/{RESOURCE}", json={"owner": "run-a", "ttl_s": 30}
    )
    assert status == 201
    fence_a = lease_a["fence"]
    status, first = await put_checkpoint(session, one, fence_a, "one")
    assert (status, first["seq"]) == (201, 1)
    assert await put_checkpoint(session, two, fence_a, "one") == (200, first)  # a retry
    done = await call(
        session,
        "POST",
        f"{two.url}/tool/work",
        json={"n": 1},
        headers=fenced_headers(RESOURCE, fence_a),
    )
    assert done.status == 200

    # taken over through the other replica
    status, _ = await api(session, two, "DELETE", f"/leases/{RESOURCE}?force=true")
    assert status == 204
    status, lease_b = await api(
        session, two, "POST", f"/leases/{RESOURCE}", json={"owner": "run-b", "ttl_s": 30}
    )
    assert status == 201
    status, refused = await put_checkpoint(session, one, fence_a, "two")
    assert (status, refused["code"]) == (409, "stale_fence")

    status, view = await api(session, one, "GET", f"/resources/{RESOURCE}")
    assert status == 200
    assert (view["state"], view["checkpoint"], view["highest_fence"]) == (
        "lease_valid",
        first,
        lease_b["fence"],
    )
    assert [r["path"] for r in view["since_checkpoint"]["completed"]] == ["/work"]

    # B's writes, all at once over both replicas: numbered without gaps or repeats
    results = await asyncio.gather(
        *(put_checkpoint(session, (one, two)[n % 2], lease_b["fence"], f"b{n}") for n in range(20))
    )
    assert sorted(body["seq"] for status, body in results if status == 201) == list(range(2, 22))
