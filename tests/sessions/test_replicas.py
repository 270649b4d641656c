"""Takeover across replicas (docs/contract.md §14, §15): a session open on replica A is cut
when a higher fence is admitted on replica B. B's call waits, as for any older call still
`pending` anywhere, until A has noticed (its watch of the store), stopped relaying, closed the
session and completed its receipt; the tool never sees the old owner after the new one.
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp

from tests.harness import call, fenced_headers
from tests.replicas.conftest import Replicas
from tests.sessions.conftest import (
    assert_nothing_after,
    closed_with,
    connect,
    old_owner_sending,
    settled_receipts,
    ws_policy,
)
from tests.sessions.ws_upstream import WsUpstream


async def test_a_session_on_one_replica_is_cut_by_a_call_admitted_on_another(
    replicas: Replicas, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    ws_upstream.echo = False
    a, b = await replicas(ws_policy(ws_upstream.url))
    old, conn, sent, sender = await old_owner_sending(session, a, ws_upstream, "ext/r", 3)

    started = time.monotonic()
    newer = await call(
        session, "POST", f"{b.url}/tool/op", headers=fenced_headers("ext/r", 4), data=b"{}"
    )
    waited = time.monotonic() - started
    closed = await closed_with(old)
    await sender
    assert newer.status == 200, newer.body
    assert (closed.data, closed.extra) == (4409, "stale_fence")
    assert waited < 2.0, waited  # A's watch looks every 75 ms; the close takes a round trip
    (forwarded,) = ws_upstream.received(path="/api/op")
    assert_nothing_after(conn, forwarded.seq, forwarded.received_at)
    assert conn.texts == sent[: len(conn.texts)]
    receipts = await settled_receipts(session, b.url, resource="ext/r")
    by_kind = {r["kind"]: r for r in receipts}
    assert by_kind["session"]["session"]["closed_by"] == "fenced"
    assert by_kind["session"]["instance"].startswith("replica-0")
    assert by_kind["call"]["instance"].startswith("replica-1")
    assert by_kind["call"]["status"] == "succeeded"


async def test_a_replica_paused_past_its_heartbeat_relays_no_more(
    replicas: Replicas, ws_upstream: WsUpstream, session: aiohttp.ClientSession
) -> None:
    """Self-fencing, per message (docs/contract.md §14): a replica that was paused longer than
    its heartbeat allows may already be given up by its peers; what its client sent during
    the pause is not relayed when it wakes, and the session ends (1011 `instance_lapsed`)."""
    (gw,) = await replicas(ws_policy(ws_upstream.url), 1, sweep_interval_s=0.2)
    ws = await connect(session, gw, "ext/p", 1)
    await ws.send_str("before")
    assert (await ws.receive(timeout=5)).data == "before"
    assert gw.proc is not None
    gw.proc.send_signal(signal.SIGSTOP)
    try:
        await ws.send_str("during the pause")
        await asyncio.sleep(1.0)  # 5 sweep intervals: lapsed (2), given up by peers (3)
    finally:
        gw.proc.send_signal(signal.SIGCONT)
    closed = await closed_with(ws)
    assert (closed.data, closed.extra) == (1011, "instance_lapsed")
    (conn,) = ws_upstream.connections
    assert conn.texts == ["before"]
