"""Defects an independent review found, each pinned by a test that failed before its fix.

The real app runs in process on a real SQLite file in front of a real recording upstream.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from gateway.config.policy_files import load_policies
from gateway.config.settings import Settings
from gateway.core.times import parse_rfc3339
from gateway.proxy import appkeys
from gateway.server.app import create_app
from gateway.store.sqlite import SqliteStore, StoreLocked
from tests.harness import Behavior, FakeClock, RecordingUpstream, make_policy, write_policy
from tests.store.test_contract import call


@pytest.fixture
async def gw(tmp_path: Path, upstream: RecordingUpstream, aiohttp_client: Any) -> Any:
    """Two upstreams over one tool: `/tool` serves `shared/*` in parallel, `/serial` serially."""
    parallel = make_policy(upstream.url, [
        {"match": "shared/*", "lease": {"issuer": "external"}},
        {"match": "signed/*", "lease": {"issuer": "external", "hmac_secret_env": "SECRET"}},
        {"match": "run/*", "lease": {"issuer": "gateway", "ttl_s": 0.3, "max_ttl_s": 5},
         "on_expiry": {"method": "DELETE", "path": "/cleanup/{name}"}},
    ], timeout_s=1)
    serial = make_policy(upstream.url, [
        {"match": "shared/*", "concurrency": "serial", "lease": {"issuer": "external"}},
    ], name="serial", mount="/serial", timeout_s=1)
    policy = write_policy(tmp_path / "p.yaml", {
        "upstreams": parallel["upstreams"] + serial["upstreams"],
        "resources": parallel["resources"] + serial["resources"]})
    settings = Settings(_env_file=None, database_url=f"sqlite:///{tmp_path}/gw.db",
                        policies=str(policy), instance_id="t", sweep_interval_s=0.1,
                        body_timeout_s=0.5, reconcile_grace_s=0)
    return await aiohttp_client(create_app(settings, load_policies(policy, {"SECRET": "s"})))


def fenced(resource: str, fence: int) -> dict[str, str]:
    return {"X-Lease-Resource": resource, "X-Fence-Token": str(fence)}


async def receipt(gw: Any, receipt_id: str) -> dict[str, Any]:
    async with gw.get(f"/_gateway/v1/receipts/{receipt_id}") as r:
        return await r.json()


class TestTakeover:
    """A newer fence never overtakes an older call in flight, and its grace counts from
    when it really left."""

    async def test_a_serial_rule_waits_for_a_parallel_rules_older_call(self, gw, upstream):
        gate = asyncio.Event()
        upstream.script("/api/old", Behavior(gate=gate))
        old = asyncio.create_task(gw.post("/tool/old", headers=fenced("shared/a", 1)))
        await upstream.wait_received(1)
        new = asyncio.create_task(gw.post("/serial/new", headers=fenced("shared/a", 2)))
        await asyncio.sleep(0.2)
        assert [r.path for r in upstream.received()] == ["/api/old"]
        gate.set()
        for task in (old, new):
            (await task).release()
        assert [r.path for r in upstream.received()] == ["/api/old", "/api/new"]

    async def test_a_call_that_waited_is_forwarded_at_when_it_left(self, gw, upstream):
        """Durably, before it leaves: if the gateway dies while the call runs, a reconciler's
        grace still counts from when the tool got it, not from its admission."""
        old_gate, new_gate = asyncio.Event(), asyncio.Event()
        upstream.script("/api/old", Behavior(gate=old_gate))
        upstream.script("/api/new", Behavior(gate=new_gate))
        old = asyncio.create_task(gw.post("/tool/old", headers=fenced("shared/b", 1)))
        await upstream.wait_received(1)
        new = asyncio.create_task(gw.post("/tool/new", headers=fenced("shared/b", 2)))
        await asyncio.sleep(0.3)
        old_gate.set()
        (await old).release()
        await upstream.wait_received(1, path="/api/new")
        [sent] = upstream.received(path="/api/new")
        pending = await receipt(gw, sent.headers["X-Receipt-Id"])
        new_gate.set()
        (await new).release()
        assert pending["status"] == "pending"
        waited = parse_rfc3339(pending["forwarded_at"]) - parse_rfc3339(pending["created_at"])
        assert waited >= 0.25


class TestStalledClient:
    """A client that stops reading its answer cannot hold its resource past the deadline."""

    async def test_new_owner_gets_through(self, gw, upstream):
        upstream.script("/api/big", Behavior(body=b"x" * (16 * 1024 * 1024)))
        _reader, writer = await asyncio.open_connection(gw.host, gw.port)
        writer.write(b"POST /tool/big HTTP/1.1\r\nHost: x\r\nX-Lease-Resource: shared/c\r\n"
                     b"X-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()  # ... and never read a byte of the answer
        await upstream.wait_received(1)
        try:
            async with gw.post("/tool/next", headers=fenced("shared/c", 2)) as answer:
                assert answer.status == 200
        finally:
            writer.close()


class TestLeases:
    async def test_a_release_after_expiry_still_owes_its_cleanup(self, tmp_path):
        clock = FakeClock(1_000.0)
        store = SqliteStore(tmp_path / "gw.db", instance="one", clock=clock)
        await store.open()
        try:
            taken = await store.acquire("run/a", "w", 0.05, 0, None, None)
            clock.advance(0.1)
            released = await store.release("run/a", "w", taken.lease.fence)
            assert (released.ok, released.held_seconds) == (True, None)
            [expired] = await store.expire_leases(lambda resource, owner: 0.0)
            assert (expired.resource, expired.fence) == ("run/a", taken.lease.fence)
            assert (await store.get_lease("run/a")).state == "expired"
            assert [c.resource for c in await store.list_cleanups()] == ["run/a"]
        finally:
            await store.close()

    async def test_the_sweeper_owner_prefix_is_reserved(self, gw):
        async with gw.post("/_gateway/v1/leases/run/b",
                           json={"owner": "gateway-sweeper:me"}) as r:
            assert (r.status, (await r.json())["code"]) == (400, "invalid_request")


class TestBadInput:
    """Every bad input is a problem+json 4xx, never a 500."""

    @pytest.mark.parametrize(("method", "path", "kwargs", "expected"), [
        ("POST", "/_gateway/v1/leases/run/c", {"data": "[" * 100_000}, (400, "invalid_request")),
        ("GET", "/_gateway/v1/receipts?fence_min=9999999999999999999", {},
         (400, "invalid_request")),
        ("DELETE", "/_gateway/v1/leases/run/c?force=maybe", {}, (400, "invalid_request")),
    ])
    async def test_refused(self, gw, method, path, kwargs, expected):
        async with gw.request(method, path, **kwargs) as r:
            assert (r.status, (await r.json())["code"]) == expected

    async def test_connect_in_authority_form_is_405(self, gw):
        reader, writer = await asyncio.open_connection(gw.host, gw.port)
        writer.write(b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert status_line.split()[1] == b"405"

    async def test_a_trickled_api_body_times_out(self, gw):
        reader, writer = await asyncio.open_connection(gw.host, gw.port)
        writer.write(b"POST /_gateway/v1/leases/run/d HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert status_line.split()[1] == b"408"


class TestMetrics:
    async def test_refusals_before_routing_by_rule_are_counted(self, gw):
        async with gw.post("/tool/x", headers={"X-Fence-Token": "1"}) as r:
            assert r.status == 428
        registry = gw.server.app[appkeys.METRICS].registry
        assert registry.get_sample_value("fence_gateway_rejections_total", {
            "upstream": "tool", "code": "missing_resource"}) == 1

    async def test_recovery_counts_lost_outcomes(self, tmp_path, upstream, aiohttp_client):
        store = SqliteStore(tmp_path / "gw.db", instance="one")
        await store.open()
        await store.admit(call(1))
        await store.close()
        policy = write_policy(tmp_path / "p.yaml", make_policy(upstream.url, [
            {"match": "acct/*"}]))
        settings = Settings(_env_file=None, database_url=f"sqlite:///{tmp_path}/gw.db",
                            policies=str(policy), instance_id="two")
        client = await aiohttp_client(create_app(settings, load_policies(policy)))
        assert client.server.app[appkeys.METRICS].registry.get_sample_value(
            "fence_gateway_outcome_unknown_total", {"upstream": "tool"}) == 1


class TestStore:
    async def test_a_second_path_to_the_same_database_is_refused(self, tmp_path):
        first = SqliteStore(tmp_path / "gw.db", instance="one")
        await first.open()
        os.symlink(tmp_path / "gw.db", tmp_path / "alias.db")
        try:
            with pytest.raises(StoreLocked):
                await SqliteStore(tmp_path / "alias.db", instance="two").open()
        finally:
            await first.close()

    async def test_ids_keep_their_order_when_the_clock_goes_back(self, tmp_path):
        """A wall clock stepped back across a restart (the one thing here that cannot be
        had for real, so the store's clock is set by hand)."""
        first = SqliteStore(tmp_path / "gw.db", instance="one")
        await first.open()
        before = await first.admit(call(1, key="a"))
        await first.close()
        second = SqliteStore(tmp_path / "gw.db", instance="two", clock=FakeClock(1e9))
        await second.open()
        try:
            after = await second.admit(call(1, key="b"))
        finally:
            await second.close()
        assert after.receipt_id > before.receipt_id



class TestSecondReview:
    async def test_a_failed_forwarded_at_write_leaves_the_call_not_sent(self, gw, upstream,
                                                                        monkeypatch):
        """A store failing between two writes cannot be had for real: that write is made
        to fail by hand. The call must then be known as never sent, not outcome_unknown."""
        from gateway.core.errors import StoreUnavailable

        async def failing(_receipt_id: str) -> None:
            raise StoreUnavailable("disk gone")

        monkeypatch.setattr(gw.server.app[appkeys.STORE], "mark_forwarded", failing)
        gate = asyncio.Event()
        upstream.script("/api/old", Behavior(gate=gate))
        old = asyncio.create_task(gw.post("/tool/old", headers=fenced("shared/e", 1)))
        await upstream.wait_received(1)
        new = asyncio.create_task(gw.post("/tool/new", headers=fenced("shared/e", 2)))
        await asyncio.sleep(0.1)
        gate.set()
        (await old).release()
        async with await new as answer:
            assert (answer.status, (await answer.json())["code"]) == (503, "store_unavailable")
            record = await receipt(gw, answer.headers["X-Receipt-Id"])
        assert (record["status"], record["error"]) == ("not_sent", "store_unavailable")
        assert [r.path for r in upstream.received()] == ["/api/old"]

    async def test_a_tools_own_replay_header_is_not_a_gateway_replay(self, gw, upstream):
        upstream.script("/api/pay", Behavior(headers={"Idempotent-Replayed": "true"}))
        async with gw.post("/tool/pay", headers=fenced("shared/f", 1)) as answer:
            assert answer.status == 200
        registry = gw.server.app[appkeys.METRICS].registry
        assert registry.get_sample_value("fence_gateway_requests_total", {
            "upstream": "tool", "result": "forwarded"}) == 1

    @pytest.mark.parametrize(("resource", "header", "status"), [
        (b"shared/g", b"X-Lease-Owner: \xff", b"400"),         # the owner check refuses it
        (b"signed/g", b"X-Fence-Signature: \xff", b"403"),     # the signature check does
    ])
    async def test_non_utf8_header_bytes_are_no_500(self, gw, upstream, resource, header,
                                                     status):
        reader, writer = await asyncio.open_connection(gw.host, gw.port)
        writer.write(b"POST /tool/x HTTP/1.1\r\nHost: x\r\nX-Lease-Resource: " + resource
                     + b"\r\nX-Fence-Token: 1\r\n" + header + b"\r\nContent-Length: 0\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert status_line.split()[1] == status
        assert upstream.received() == []
