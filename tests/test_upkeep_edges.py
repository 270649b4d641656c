"""Background upkeep at its edges (docs/contract.md §7, §9, §14, §15): a peer's sweep spares
a call still waiting its turn, a probe asks about a named operation or not at all, a failing
cleanup backs off however long it fails, a session that ended unrecorded is judged lost, and
the reconcile grace is judged by the database's clock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.harness import (
    Behavior,
    GatewayFactory,
    RecordingUpstream,
    call,
    fenced_headers,
    make_policy,
)
from tests.pg import create_database, drop_database, url_of


@pytest.fixture
def pg_url() -> Iterator[str]:
    name = create_database()
    yield url_of(name)
    drop_database(name)


async def _receipts(session: aiohttp.ClientSession, url: str, **query: Any) -> list[dict[str, Any]]:
    async with session.get(f"{url}/_gateway/v1/receipts", params=query) as resp:
        assert resp.status == 200, await resp.text()
        return list((await resp.json())["items"])


class TestPeerSweeperAndWaitingCalls:
    """§14: "every guarantee of sections 3, 4, 6, 7 and 9 holds across replicas exactly as in
    one process". One SQLite gateway never turns a call it still has in flight (here: waiting
    behind older fences before it is sent) `outcome_unknown`; a peer's sweeper on PostgreSQL
    must not either, or a reconciler may resolve it `not_applied` and the call then goes out."""

    async def test_a_peer_does_not_turn_a_call_waiting_its_turn_outcome_unknown(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
        pg_url: str,
    ) -> None:
        policy = make_policy(
            upstream.url,
            [{"match": "acct/*", "queue_timeout_s": 20}],
            timeout_s=1,
        )
        upstream.script("/api/slow", Behavior(delay=0.8))
        env = {"GATEWAY_DATABASE_URL": pg_url, "GATEWAY_RECONCILE_GRACE_S": "0"}
        front, peer = await asyncio.gather(
            gateway_factory(
                policy, sweep_interval_s=0.1, extra_env=env | {"GATEWAY_INSTANCE_ID": "front"}
            ),
            gateway_factory(
                policy, sweep_interval_s=0.1, extra_env=env | {"GATEWAY_INSTANCE_ID": "peer"}
            ),
        )

        async def send(fence: int, path: str) -> Any:
            return await call(
                session,
                "POST",
                f"{front.url}/tool/{path}",
                data=f"{fence}".encode(),
                headers=fenced_headers("acct/1", fence),
            )

        first = asyncio.create_task(send(1, "slow"))
        await upstream.wait_received(1, path="/api/slow")
        second = asyncio.create_task(send(2, "slow"))
        await asyncio.sleep(0.1)
        third = asyncio.create_task(send(3, "fast"))  # waits for fences 1 and 2 (~1.5 s)

        resolved = None
        while not third.done():
            [mine] = await _receipts(session, peer.url, resource="acct/1", fence_min=3) or [None]
            if (
                mine is not None
                and mine["status"] == "outcome_unknown"
                and not upstream.received(path="/api/fast")
                and resolved is None
            ):
                # the reconciler's move, allowed once a receipt is outcome_unknown past grace
                async with session.post(
                    f"{peer.url}/_gateway/v1/receipts/{mine['id']}/resolve",
                    json={"outcome": "not_applied", "source": "operator:alice"},
                ) as resp:
                    resolved = resp.status
            await asyncio.sleep(0.05)
        results = await asyncio.gather(first, second, third)
        assert [r.status for r in results] == [200, 200, 200]
        assert resolved is None, (
            "the peer's sweeper turned fence 3's call outcome_unknown while it waited, unsent, "
            f"behind fences 1 and 2; a reconciler resolved it not_applied ({resolved}), and the "
            f"call then went to the tool anyway: {len(upstream.received(path='/api/fast'))} sent"
        )
        [receipt] = await _receipts(session, peer.url, resource="acct/1", fence_min=3)
        assert (receipt["status"], receipt["late"]) == ("succeeded", False), receipt


class TestProbeOfASessionReceipt:
    """§7: a probe's 2xx means "the tool holds a record of this operation". A session's receipt
    has no idempotency key, so `probe: GET /operations/{idempotency_key}` asks for
    `/operations/` (the whole collection): its 200 says nothing about the session."""

    async def test_a_probe_without_the_key_it_names_does_not_resolve_applied(
        self, gateway_factory: GatewayFactory, session: aiohttp.ClientSession
    ) -> None:
        from tests.sessions.conftest import connect
        from tests.sessions.ws_upstream import WsUpstream

        async with WsUpstream() as tool:
            policy = make_policy(
                tool.url,
                [
                    {
                        "match": "ext/*",
                        "probe": {"method": "GET", "path": "/operations/{idempotency_key}"},
                    }
                ],
                timeout_s=0.3,
                websocket=True,
            )
            gateway = await gateway_factory(policy, extra_env={"GATEWAY_RECONCILE_GRACE_S": "0"})
            ws = await connect(session, gateway, "ext/browser-1", 1)
            await tool.wait_connections(1)
            await gateway.kill9()  # a session open when the gateway dies: outcome_unknown
            await ws.close()
            await gateway.restart()
            [receipt] = await _receipts(session, gateway.url, resource="ext/browser-1")
            assert (receipt["kind"], receipt["status"]) == ("session", "outcome_unknown")
            assert receipt["idempotency_key"] is None
            await asyncio.sleep(0.4)  # past forwarded_at + timeout_s + grace
            async with session.post(
                f"{gateway.url}/_gateway/v1/receipts/{receipt['id']}/probe"
            ) as resp:
                answer = await resp.json(content_type=None)
            asked = [r.path_qs for r in tool.received(method="GET")]
            assert answer.get("status") != "reconciled", (
                f"probed {asked}, and the collection's 200 resolved the session: "
                f"{answer.get('resolution')}"
            )


class TestAFailingCleanupBacksOff:
    """§9: a failed cleanup is retried later, with backoff (gateway.upkeep.cleanup: at most
    MAX_RETRY_S between tries). A tool that answers the cleanup 404 for good (the session it
    deletes is already gone) fails it at every try; after about 1,000 tries (17 hours at one
    a minute) the backoff's `2 ** (attempt - 1)` no longer converts to a float, `_settle`
    raises before it notes the retry time, and the cleanup is sent at every sweep."""

    async def test_the_1025th_failure_still_waits_before_the_next_try(
        self, make_app: Any, upstream: RecordingUpstream
    ) -> None:
        policy = make_policy(
            upstream.url,
            [
                {
                    "match": "browser/*",
                    "lease": {"issuer": "gateway", "ttl_s": 0.2, "lock_delay_s": 0.5},
                    "on_expiry": {"method": "DELETE", "path": "/sessions/{name}"},
                }
            ],
        )
        upstream.script("/api/sessions/s1", Behavior(status=404, body=b"{}"))
        gw = await make_app(policy, sweep_interval_s=0.05)
        status, _, _ = await gw.acquire("browser/s1", ttl_s=0.2)
        assert status == 201

        async def owed() -> list[Any]:
            return await gw.store.list_cleanups()

        deadline = time.monotonic() + 5
        while not await owed():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        # the state after 1,024 failed tries: the row as those tries left it
        await gw.store._write(  # type: ignore[attr-defined]
            lambda conn: conn.execute("UPDATE cleanups SET attempts = 1024")
        )
        await upstream.wait_received(1, method="DELETE", timeout=5)
        await asyncio.sleep(1.0)  # twenty sweeps
        tries = upstream.received(method="DELETE")
        [row] = await owed()
        assert len(tries) == 1, f"the cleanup was sent {len(tries)} times in a second (row: {row})"
        assert row.due_at > time.time() + 30, row


class TestAClosedSessionWhoseOutcomeWasNotRecorded:
    """§3: an outcome the store would not take leaves the receipt `pending`, "so it becomes
    `outcome_unknown`"; §15 spares only an *open* session's receipt the age rule. A session
    that ended while the outcome write failed is no longer open, yet the sweeper leaves its
    receipt `pending` for as long as the process lives. On PostgreSQL a pending call of a
    lower fence holds back every newer call of the resource (§14), so from then on every call
    of the resource waits `queue_timeout_s` and is answered 503 resource_busy."""

    async def test_it_becomes_outcome_unknown_and_holds_back_no_newer_call(
        self, gateway_factory: GatewayFactory, session: aiohttp.ClientSession, pg_url: str
    ) -> None:
        from tests.sessions.conftest import connect
        from tests.sessions.ws_upstream import WsUpstream

        async with WsUpstream() as tool:
            policy = make_policy(
                tool.url,
                [{"match": "ext/*", "queue_timeout_s": 1}],
                timeout_s=0.3,
                websocket=True,
            )
            gateway = await gateway_factory(
                policy,
                sweep_interval_s=0.1,
                extra_env={
                    "GATEWAY_DATABASE_URL": pg_url,
                    "GATEWAY_RECONCILE_GRACE_S": "0",
                    "GATEWAY_FAILPOINTS": "after_upstream=error",  # outcome writes fail
                },
            )
            ws = await connect(session, gateway, "ext/b1", 1)
            await tool.wait_connections(1)
            await ws.close()
            await tool.wait_ended(tool.connections[0])
            # forwarded_at + timeout_s + grace (+ queue_timeout_s) is long past
            await asyncio.sleep(2.0)
            [receipt] = await _receipts(session, gateway.url, resource="ext/b1")
            newer = await call(
                session,
                "POST",
                f"{gateway.url}/tool/click",
                data=b"{}",
                headers=fenced_headers("ext/b1", 2),
            )
            assert (receipt["status"], newer.status) == ("outcome_unknown", 200), (
                receipt["status"],
                newer.status,
                newer.body[:200],
            )


class TestTheGraceIsJudgedByTheDatabasesClock:
    """§14: "Times that decide expiry are the database's, never a replica's clock"; §7: a
    receipt is reconcilable only `GATEWAY_RECONCILE_GRACE_S` after `forwarded_at` +
    `timeout_s`. The outcome write on PostgreSQL replaces `forwarded_at` (the database's time
    of admission) with the replica's own clock: a replica whose clock is a minute behind
    makes its timed-out calls reconcilable at once, while the tool may still be running them."""

    async def test_a_replica_clock_behind_does_not_shorten_the_grace(
        self,
        make_app: Any,
        upstream: RecordingUpstream,
        pg_url: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        import types

        from gateway.proxy import forward

        real = time.time
        skewed = types.SimpleNamespace(time=lambda: real() - 60, perf_counter=time.perf_counter)
        monkeypatch.setattr(forward, "time", skewed)  # this replica's clock: a minute behind
        upstream.script("/api/slow", Behavior(delay=3))
        gw = await make_app(
            make_policy(upstream.url, [{"match": "acct/*"}], timeout_s=0.5),
            database_url=pg_url,
            reconcile_grace_s=5,
        )
        status, headers, _ = await gw.send(
            "POST", "/tool/slow", data=b"{}", headers=fenced_headers("acct/1", 1)
        )
        assert status == 504  # the call may still be running at the tool, for 2.5 s more
        status, _, body = await gw.send(
            "POST",
            f"/_gateway/v1/receipts/{headers['X-Receipt-Id']}/resolve",
            json={"outcome": "not_applied", "source": "operator:alice"},
        )
        assert status == 409, (
            "resolved not_applied 0.5 s after it was sent, with 5 s of grace to go: "
            f"forwarded_at={body.get('forwarded_at')}"
        )
