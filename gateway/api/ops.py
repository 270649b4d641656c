"""Health, readiness and metrics (docs/contract.md §10)."""

from __future__ import annotations

import contextlib

from aiohttp import web

from gateway.core import errors
from gateway.proxy import appkeys
from gateway.upkeep.sweeper import heartbeat

routes = web.RouteTableDef()


@routes.get("/_gateway/healthz")
async def healthz(_request: web.Request) -> web.Response:
    """The process is up: nothing more is checked."""
    return web.json_response({"status": "ok"})


@routes.get("/_gateway/readyz")
async def readyz(request: web.Request) -> web.Response:
    """Ready when the store answers and accepts a write, and policies are loaded."""
    app = request.app
    try:
        await heartbeat(app)
    except errors.StoreUnavailable as exc:
        raise errors.StoreUnavailable(f"the store does not accept writes: {exc}") from None
    return web.json_response(
        {
            "status": "ready",
            "instance": app[appkeys.STORE].instance,
            "upstreams": sorted(app[appkeys.POLICIES].upstreams),
        }
    )


@routes.get("/_gateway/metrics")
async def metrics(request: web.Request) -> web.Response:
    app = request.app
    collectors = app[appkeys.METRICS]
    with contextlib.suppress(errors.StoreUnavailable):  # keep the last value; see readyz
        collectors.outcome_unknown_oldest.set(await app[appkeys.STORE].oldest_unknown_age())
    return web.Response(
        body=collectors.render(),
        content_type="text/plain",
        charset="utf-8",
        headers={"X-Content-Type-Options": "nosniff"},
    )
