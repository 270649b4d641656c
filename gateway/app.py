"""`create_app(settings, policies)`: the aiohttp application, every resource opened in a
cleanup_ctx so that its cleanup runs if and only if its start-up finished."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from gateway import keys, proxy
from gateway.api import leases, openapi, ops, receipts
from gateway.auth import Clients, authenticate
from gateway.failpoints import Failpoints
from gateway.metrics import Metrics
from gateway.middleware import problems
from gateway.ordering import Lanes
from gateway.policy import PolicySet
from gateway.settings import Settings
from gateway.store import create_store
from gateway.sweeper import count_lost, sweeper_ctx
from gateway.upstream import Upstreams


def create_app(settings: Settings, policies: PolicySet,
               clients: Clients | None = None) -> web.Application:
    app = web.Application(middlewares=[problems, authenticate], client_max_size=1024**2)
    app[keys.CLIENTS] = clients
    app[keys.SETTINGS] = settings
    app[keys.POLICIES] = policies
    app[keys.METRICS] = Metrics()
    app[keys.LANES] = Lanes()
    app[keys.IN_FLIGHT] = set()
    app[keys.FAILPOINTS] = Failpoints(settings.failpoint_map)
    app.cleanup_ctx.extend([_store_ctx, _upstreams_ctx, sweeper_ctx])
    app.router.add_routes(ops.routes)
    app.router.add_routes(receipts.routes)
    app.router.add_routes(leases.routes)
    app.router.add_routes(openapi.routes)
    app.router.add_route("*", "/_gateway/{tail:.*}", _not_found)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    return app


async def _not_found(request: web.Request) -> web.Response:
    raise web.HTTPNotFound(reason=f"no gateway endpoint {request.method} {request.path}")


async def _store_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[keys.SETTINGS]
    store = create_store(settings.database_url, instance=settings.instance_id,
                         durability=settings.durability,
                         before_commit=app[keys.FAILPOINTS].in_commit)
    await store.open()
    app[keys.STORE] = store
    count_lost(app, store.recovered)
    yield
    await store.close()


async def _upstreams_ctx(app: web.Application) -> AsyncIterator[None]:
    upstreams = Upstreams(app[keys.POLICIES].upstreams)
    await upstreams.open()
    app[keys.UPSTREAMS] = upstreams
    yield
    await upstreams.close()
