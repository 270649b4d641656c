"""The watch over open sessions (docs/contract.md §15): a session ends when its fence or its
lease stops being current, wherever that was decided.

On this process a newer fence cuts its resource's sessions the moment it is admitted
(`gateway.proxy.forward.admit`). What this process cannot see is decided in the store: a
higher fence admitted by another replica sharing it (PostgreSQL, §14), and a gateway-issued
lease that expired, was released or was revoked. So every open session's resource is looked
up in the store, all of them in one read, a few times a second when replicas share the store
(a newer call on a peer waits, within its `queue_timeout_s`, until the session here is cut
and its receipt completed) and twice per sweep interval otherwise (a lease's end is noticed
within one sweep interval).
"""

from __future__ import annotations

from aiohttp import web

from gateway.core.sessions import watch_verdict
from gateway.observe import logs
from gateway.proxy import appkeys
from gateway.upkeep.periodic import every

SHARED_STORE_PERIOD_S = 0.075  # one read per period for all open sessions, when replicas share


def period(app: web.Application) -> float:
    half_sweep = app[appkeys.SETTINGS].sweep_interval_s / 2
    return min(SHARED_STORE_PERIOD_S, half_sweep) if app[appkeys.STORE].shared else half_sweep


async def watch_once(app: web.Application) -> None:
    """Cut every open session whose fence or lease is no longer current, or that this
    process may no longer relay for (a quiet session is not left waiting for its next
    message to find that out)."""
    store = app[appkeys.STORE]
    open_sessions = app[appkeys.SESSIONS].by_resource()
    for sessions in open_sessions.values():
        for session in sessions:
            if session.relaying and not store.may_forward(session.instance):
                session.lapse()
    if not open_sessions:
        return
    states = await store.fence_states(sorted(open_sessions))
    for resource, sessions in open_sessions.items():
        for session in sessions:
            verdict = watch_verdict(session.fence, session.issuer, states.get(resource))
            if verdict is not None and session.relaying:
                session.cut(verdict)
                logs.event(
                    "session_cut",
                    resource=resource,
                    fence=session.fence,
                    receipt_id=session.receipt_id,
                    closed_by=verdict,
                )


async def watch(app: web.Application) -> None:
    await every(period(app), lambda: watch_once(app), "session_watch")
