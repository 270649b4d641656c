"""Typed application state (`web.AppKey`), named once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.config.clients import Client, Clients
    from gateway.config.policy import PolicySet
    from gateway.config.settings import Settings
    from gateway.observe.metrics import Metrics
    from gateway.proxy.failpoints import Failpoints
    from gateway.proxy.flow import Flow
    from gateway.proxy.ordering import Lanes
    from gateway.proxy.sessions import OpenSessions
    from gateway.proxy.slot import Slot
    from gateway.proxy.traces import Tracing
    from gateway.proxy.upstream import Upstreams
    from gateway.store import Store

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
# The sessions (fenced WebSockets, docs/contract.md §15) open in this process.
SESSIONS: web.AppKey[OpenSessions] = web.AppKey("sessions")
# Tracing (docs/contract.md §21): the hook of `gateway.proxy.traces`; None when it is off.
TRACING: web.AppKey[Tracing | None] = web.AppKey("tracing")

# Per-request state: the request id (set first, by the middleware), the authenticated client,
# and the flow the call path fills in (read back by the middleware's problem and log line).
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
CLIENT: web.RequestKey[Client] = web.RequestKey("client")
FLOW: web.RequestKey[Flow] = web.RequestKey("flow")
# A POST to an MCP upstream is answered in JSON-RPC (docs/contract.md §16): the request's
# JSON-RPC id once read, for the error answers; absent until then (an error answers id null).
JSONRPC_ID: web.RequestKey[str | int | None] = web.RequestKey("jsonrpc_id")
# A call GATEWAY_MAX_INFLIGHT counts: its place, for a stream to give back early (§11).
SLOT: web.RequestKey[Slot] = web.RequestKey("inflight_slot")
