"""`create_app(settings, policies)`: the aiohttp application, every resource opened in a
cleanup_ctx so that its cleanup runs if and only if its start-up finished."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.api import checkpoints, fences, leases, openapi, ops, receipts
from gateway.config.clients import Clients
from gateway.config.policy import PolicySet
from gateway.config.settings import Settings
from gateway.console.mount import mount as mount_console
from gateway.observe import logs
from gateway.observe.metrics import Metrics
from gateway.proxy import appkeys, handler, sessions
from gateway.proxy.failpoints import Failpoints
from gateway.proxy.ordering import Lanes
from gateway.proxy.upstream import Upstreams
from gateway.server import overload
from gateway.server.auth import authenticate
from gateway.server.middleware import problems
from gateway.store import create_store
from gateway.upkeep import failover
from gateway.upkeep.sweeper import count_lost, sweeper_ctx


def create_app(
    settings: Settings, policies: PolicySet, clients: Clients | None = None
) -> web.Application:
    app = web.Application(middlewares=[problems, authenticate], client_max_size=1024**2)
    app[appkeys.CLIENTS] = clients
    app[appkeys.SETTINGS] = settings
    app[appkeys.POLICIES] = policies
    app[appkeys.METRICS] = Metrics(settings.replication)
    overload.install(app, settings.max_inflight)  # applied by the HTTP server, on each head
    app[appkeys.LANES] = Lanes()
    app[failover.SAID] = failover.Said()
    app[appkeys.IN_FLIGHT] = set()
    sessions.install(app)  # fenced WebSockets: the open ones, and their end at shutdown
    app[appkeys.FAILPOINTS] = Failpoints(settings.failpoint_map)
    app[appkeys.TRACING] = None  # until _tracing_ctx, when GATEWAY_OTEL is set
    app.cleanup_ctx.extend([_tracing_ctx, _store_ctx, _upstreams_ctx, sweeper_ctx])
    app.router.add_routes(ops.routes)
    app.router.add_routes(receipts.routes)
    app.router.add_routes(leases.routes)
    app.router.add_routes(checkpoints.routes)
    app.router.add_routes(fences.routes)
    app.router.add_routes(openapi.routes)
    mount_console(app)  # /_gateway/console: before the catch-alls below
    # [\s\S]: any character, a line end too (`.` stops at one, and a path may hold %0A)
    app.router.add_route("*", r"/_gateway/{tail:[\s\S]*}", _not_found)
    app.router.add_route("*", r"/{tail:[\s\S]*}", handler.handle)
    return app


async def _not_found(request: web.Request) -> web.Response:
    raise web.HTTPNotFound(reason=f"no gateway endpoint {request.method} {request.path}")


async def _store_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[appkeys.SETTINGS]
    # the proxied calls in progress (counted whether limited or not), less those waiting for
    # their turn: the calls at work, for SQLite's group commit
    limit, lanes = app[overload.LIMIT], app[appkeys.LANES]
    store = create_store(
        settings.database_url,
        instance=settings.instance_id,
        durability=settings.durability,
        before_commit=app[appkeys.FAILPOINTS].in_commit,
        active_calls=lambda: limit.in_flight - lanes.waiting_turns,
        heartbeat_interval_s=settings.sweep_interval_s,
        replication=settings.replication,
        sync_wait_s=settings.sync_wait_s,
        fence_gap=settings.restore_fence_gap,
        connect_timeout_s=settings.database_connect_timeout_s,
    )
    await store.open()
    for event, detail in store.open_warnings:
        logs.event(event, logging.WARNING, detail=detail)
    app[appkeys.STORE] = store
    count_lost(app, store.recovered)
    yield
    await store.close()


async def _tracing_ctx(app: web.Application) -> AsyncIterator[None]:
    """With GATEWAY_OTEL, the tracing hook (docs/contract.md §21); its module, and with it
    opentelemetry, is imported only then. Made in each worker, after any fork."""
    if not app[appkeys.SETTINGS].otel:
        yield
        return
    from gateway.proxy.traces import Tracing

    tracing = app[appkeys.TRACING] = Tracing(app[appkeys.POLICIES])
    yield
    await tracing.close()


async def _upstreams_ctx(app: web.Application) -> AsyncIterator[None]:
    tracing = app[appkeys.TRACING]
    configured = app[appkeys.POLICIES].upstreams
    upstreams = Upstreams(configured) if tracing is None else tracing.upstreams(configured)
    await upstreams.open()
    app[appkeys.UPSTREAMS] = upstreams
    yield
    await upstreams.close()
