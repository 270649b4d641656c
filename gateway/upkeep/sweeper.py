"""The background upkeep of docs/contract.md §9.

The heartbeat has a task of its own, twice per `GATEWAY_SWEEP_INTERVAL_S`, so that a slow
sweep never makes the instance lapse (`gateway.core.liveness`). The sweep runs one pass every
interval:

* mark expired leases `expired` (and record how long they were held), scheduling the rule's
  `on_expiry` cleanup in the same transaction where there is one;
* turn lost `pending` receipts `outcome_unknown`;
* delete idempotency keys and completed receipts past their retention, and checkpoints past
  theirs (§17);
* start the owed cleanups that are due (`gateway.cleanup`: they run as their own tasks, so a
  slow cleanup call never holds up the next pass).

A pass that fails (the store is down) is logged and the next one tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.core import errors
from gateway.core.liveness import SILENT_INTERVALS
from gateway.observe import logs
from gateway.proxy import appkeys
from gateway.upkeep import failover
from gateway.upkeep.cleanup import Cleaner
from gateway.upkeep.periodic import every
from gateway.upkeep.reconcile import wait_times
from gateway.upkeep.session_watch import watch

HEARTBEATS_PER_INTERVAL = 2


async def sweep_once(app: web.Application, cleaner: Cleaner | None = None) -> None:
    settings, store = app[appkeys.SETTINGS], app[appkeys.STORE]
    cleaner = cleaner or Cleaner(app)
    await expire_leases(app, cleaner)
    in_flight_here: set[str] = app[appkeys.IN_FLIGHT]
    in_flight = frozenset(in_flight_here)
    lost = await store.expire_pending(
        wait_times(app), SILENT_INTERVALS * settings.sweep_interval_s, in_flight
    )
    count_lost(app, lost)
    await store.prune(settings.receipt_retention_s)
    await store.prune_checkpoints()  # docs/contract.md §17: the last one is always kept
    await cleaner.start_due()


async def expire_leases(app: web.Application, cleaner: Cleaner) -> None:
    """Mark the leases past their expiry expired, each owing its `on_expiry` cleanup
    (docs/contract.md §9): the sweep's first step, and a revoke's (`gateway.api.leases`)."""
    metrics = app[appkeys.METRICS]
    for lease in await app[appkeys.STORE].expire_leases(cleaner.owed_after):
        metrics.held.observe(max(0.0, lease.expires_at - lease.acquired_at))
        logs.event("lease_expired", resource=lease.resource, fence=lease.fence, owner=lease.owner)


def count_lost(app: web.Application, lost: dict[str, int]) -> None:
    """Receipts turned `outcome_unknown` (by recovery or the sweeper), per upstream."""
    for upstream, count in lost.items():
        app[appkeys.METRICS].outcome_unknown.labels(upstream).inc(count)
        logs.event("receipts_outcome_unknown", logging.WARNING, upstream=upstream, count=count)


async def sweeper_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the sweeper runs exactly while the app is up; cleanups in flight get the
    shutdown grace to finish and record their outcomes."""
    cleaner = Cleaner(app)
    interval = app[appkeys.SETTINGS].sweep_interval_s
    loops = {
        "heartbeat": every(interval / HEARTBEATS_PER_INTERVAL, lambda: heartbeat(app), "heartbeat"),
        "sweeper": every(interval, lambda: sweep_once(app, cleaner), "sweep"),
        "session-watch": watch(app),  # docs/contract.md §15
    }
    tasks = [asyncio.create_task(loop, name=name) for name, loop in loops.items()]
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await cleaner.close(app[appkeys.SETTINGS].shutdown_grace_s)


async def heartbeat(app: web.Application) -> None:
    """Renew this instance's heartbeat; say so when the store made it go on under a new id,
    and what became of the store's epochs and replication meanwhile (`failover.report`).

    `fence_gateway_ready` follows what `readyz` would say: 0 while the heartbeat fails, which
    under `GATEWAY_REPLICATION=sync` includes a renewal that found replication not
    synchronous (the store raises after it: this replica admits nothing meanwhile)."""
    store = app[appkeys.STORE]
    before = store.instance
    ready = app[appkeys.METRICS].ready
    try:
        await store.heartbeat()
    except errors.StoreUnavailable:
        ready.set(0)
        raise
    else:
        ready.set(1)
    finally:
        failover.report(app)
        if store.instance != before:  # said even when a check after the renewal failed
            logs.event(
                "instance_lapsed",
                logging.ERROR,
                instance=before,
                now=store.instance,
                detail="silent too long for the store: calls admitted under the old id are "
                "not sent",
            )
