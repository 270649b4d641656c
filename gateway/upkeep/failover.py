"""What a failover of the PostgreSQL primary did, said once (docs/contract.md §19): each new
store epoch this replica recorded (`store_epoch_changed`, at error level when the fence floor
was applied, and `fence_gateway_store_epochs_total{floor}`), and synchronous replication
going missing (`replication_not_synchronous`, `fence_gateway_replication_synchronous` 0) or
coming back under `GATEWAY_REPLICATION=sync`.

The store records; this module, run after every heartbeat, reports.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aiohttp import web

from gateway.observe import logs
from gateway.proxy import appkeys


@dataclass
class Said:
    """The replication problem last logged ("" none), so that each is said once."""

    problem: str = ""


SAID = web.AppKey("replication_problem_said", Said)


def report(app: web.Application) -> None:
    store, metrics = app[appkeys.STORE], app[appkeys.METRICS]
    for change in store.drain_epoch_changes():
        applied = change.floor is not None
        metrics.store_epochs.labels("applied" if applied else "not_needed").inc()
        fields: dict[str, object] = {
            "previous": str(change.previous) if change.previous else "none",
            "epoch": str(change.current),
            "reason": change.reason,
            "floor_applied": applied,
        }
        if change.floor is not None:
            fields |= {
                "floor": change.floor.floor,
                "leases_expired": change.floor.leases_expired,
                "receipts_unknown": sum(change.floor.receipts_unknown.values()),
                "detail": "external resources are on hold until raised: "
                "fence-gateway fences raise GLOB --to N",
            }
        logs.event("store_epoch_changed", logging.ERROR if applied else logging.WARNING, **fields)
    problem = store.replication_problem
    if metrics.replication_synchronous is not None:  # GATEWAY_REPLICATION=sync
        metrics.replication_synchronous.set(problem is None)
    said = app[SAID]
    if problem is not None and problem != said.problem:
        logs.event(
            "replication_not_synchronous",
            logging.ERROR,
            detail=f"{problem}: nothing is admitted until it is",
        )
    elif problem is None and said.problem:
        logs.event("replication_synchronous", detail="admissions resume")
    said.problem = problem or ""
