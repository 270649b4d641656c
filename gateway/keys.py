"""Typed application state (`web.AppKey`), named once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.auth import Client, Clients
    from gateway.failpoints import Failpoints
    from gateway.metrics import Metrics
    from gateway.ordering import Lanes
    from gateway.policy import PolicySet
    from gateway.settings import Settings
    from gateway.store import Store
    from gateway.upstream import Upstreams

SETTINGS: web.AppKey[Settings] = web.AppKey("settings")
POLICIES: web.AppKey[PolicySet] = web.AppKey("policies")
STORE: web.AppKey[Store] = web.AppKey("store")
UPSTREAMS: web.AppKey[Upstreams] = web.AppKey("upstreams")
LANES: web.AppKey[Lanes] = web.AppKey("lanes")
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")
FAILPOINTS: web.AppKey[Failpoints] = web.AppKey("failpoints")
CLIENTS: web.AppKey[Clients | None] = web.AppKey("clients")  # None: the gateway runs open
# Receipt ids this process has admitted and not yet recorded: never "lost" to the sweeper.
IN_FLIGHT: web.AppKey[set[str]] = web.AppKey("in_flight")

# Per-request state, set by the proxy handler and read by the middleware's log line.
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
LOG_FIELDS: web.RequestKey[dict[str, object]] = web.RequestKey("log_fields", dict)
CLIENT: web.RequestKey[Client] = web.RequestKey("client")
REPLAYED: web.RequestKey[bool] = web.RequestKey("replayed", bool)  # answered from the store
