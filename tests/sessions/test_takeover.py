"""Takeover cuts the old session (docs/contract.md §15): when a call or a session with a higher
fence is admitted for the resource, the open session with the lower fence stops relaying at
once and is closed (4409 `stale_fence`) before the newer call reaches the tool. The old
owner keeps sending all along; the tool's own record of arrival order is the evidence. And a
session of a gateway-issued lease ends (4408) when the lease expires, is released or is
revoked.
"""

from __future__ import annotations

import time

import aiohttp
from aiohttp import WSMsgType

from tests.harness import GatewayFactory, call, fenced_headers
from tests.sessions.conftest import (
    assert_nothing_after,
    closed_with,
    connect,
    old_owner_sending,
    settled_receipts,
    ws_policy,
)
from tests.sessions.ws_upstream import WsUpstream

SWEEP_S = 0.2
LEASES = "/_gateway/v1/leases"


async def test_an_http_call_with_a_higher_fence_cuts_the_session_before_it_is_forwarded(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    ws_upstream.echo = False
    gw = await gateway_factory(ws_policy(ws_upstream.url), sweep_interval_s=SWEEP_S)
    old, conn, sent, sender = await old_owner_sending(session, gw, ws_upstream, "ext/t", 3)

    newer = await call(
        session, "POST", f"{gw.url}/tool/op", headers=fenced_headers("ext/t", 4), data=b"{}"
    )
    closed = await closed_with(old)
    await sender
    assert newer.status == 200
    assert (closed.type, closed.data, closed.extra) == (WSMsgType.CLOSE, 4409, "stale_fence")
    (forwarded,) = ws_upstream.received(path="/api/op")
    assert forwarded.fence == 4
    assert_nothing_after(conn, forwarded.seq, forwarded.received_at)
    assert conn.close_code == 4409  # the tool was told too
    assert len(conn.texts) < len(sent) + 1  # what it got is a prefix of what was sent, in order
    assert conn.texts == sent[: len(conn.texts)]

    receipts = await settled_receipts(session, gw.url, resource="ext/t")
    old_receipt = next(r for r in receipts if r["kind"] == "session")
    assert old_receipt["status"] == "succeeded"
    assert old_receipt["session"]["closed_by"] == "fenced"
    assert old_receipt["session"]["close_code"] == 4409
    assert old_receipt["session"]["messages_in"] == len(conn.texts)
    # the old owner cannot come back
    try:
        await connect(session, gw, "ext/t", 3)
        raise AssertionError("a stale session was opened")
    except aiohttp.WSServerHandshakeError as refused:
        assert refused.status == 409
    assert len(ws_upstream.connections) == 1


async def test_a_new_session_cuts_the_old_one_and_waits_for_a_tool_that_will_not_close(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    """The newer session is opened only once the old one is closed toward the tool: after its
    close reply, or after one second when the tool does not answer (then the connection is
    aborted)."""
    gw = await gateway_factory(ws_policy(ws_upstream.url), sweep_interval_s=SWEEP_S)
    for answer_close, round_ in ((True, "answered"), (False, "ignored")):
        resource = f"ext/{round_}"
        ws_upstream.answer_close = answer_close
        ws_upstream.echo = False
        old, old_conn, _, sender = await old_owner_sending(
            session, gw, ws_upstream, resource, 1, received=10
        )

        started = time.monotonic()
        new = await connect(session, gw, resource, 2)
        waited = time.monotonic() - started
        new_conn = ws_upstream.connections[-1]
        closed = await closed_with(old)
        await sender
        assert (closed.data, closed.extra) == (4409, "stale_fence")
        assert new_conn is not old_conn and new_conn.fence == 2
        assert_nothing_after(old_conn, new_conn.seq, new_conn.opened_at)
        if answer_close:
            assert waited < 0.9, waited
        else:  # one second for the close reply, then the connection was aborted
            assert 0.9 <= waited < 3, waited
        await new.send_str("mine now")
        await ws_upstream.wait_messages(new_conn, 1)
        assert new_conn.texts == ["mine now"]
        await new.close()


async def test_a_gateway_lease_that_expires_is_released_or_is_revoked_ends_its_session(
    gateway_factory: GatewayFactory, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    gw = await gateway_factory(ws_policy(ws_upstream.url), sweep_interval_s=SWEEP_S)
    leases = {}
    for name, ttl in (("expires", 1.0), ("released", 30), ("revoked", 30), ("kept", 30)):
        async with session.post(
            f"{gw.url}{LEASES}/gw/{name}", json={"owner": f"run-{name}", "ttl_s": ttl}
        ) as answer:
            assert answer.status == 201
            leases[name] = await answer.json()
    sockets = {
        name: await connect(session, gw, f"gw/{name}", lease["fence"])
        for name, lease in leases.items()
    }
    started = time.monotonic()
    async with session.delete(
        f"{gw.url}{LEASES}/gw/released",
        params={"owner": "run-released", "fence": str(leases["released"]["fence"])},
    ) as answer:
        assert answer.status == 204
    async with session.delete(f"{gw.url}{LEASES}/gw/revoked", params={"force": "true"}) as answer:
        assert answer.status == 204
    for name in ("released", "revoked"):
        closed = await closed_with(sockets[name])
        assert (closed.data, closed.extra) == (4408, "lease_expired")
        assert time.monotonic() - started < SWEEP_S + 0.8  # one sweep interval, and slack
    closed = await closed_with(sockets["expires"])
    assert (closed.data, closed.extra) == (4408, "lease_expired")
    expired_after = time.monotonic() - started
    assert expired_after < 1.0 + SWEEP_S + 0.8, expired_after
    await sockets["kept"].send_str("still mine")
    kept = next(c for c in ws_upstream.connections if c.headers["X-Lease-Resource"] == "gw/kept")
    await ws_upstream.wait_messages(kept, 1)
    await sockets["kept"].close()
    receipts = await settled_receipts(session, gw.url)
    ended = sorted(
        (r["resource"], r["session"]["closed_by"], r["session"]["close_code"])
        for r in receipts
        if r["kind"] == "session" and r["session"] and r["resource"] != "gw/kept"
    )
    assert ended == [
        ("gw/expires", "lease_ended", 4408),
        ("gw/released", "lease_ended", 4408),
        ("gw/revoked", "lease_ended", 4408),
    ]
