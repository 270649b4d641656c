"""Tracing of proxied calls with OpenTelemetry (docs/contract.md §21).

Imported only with `GATEWAY_OTEL=true` (`gateway.server.app` imports it then, and nothing
else of the gateway imports opentelemetry): when tracing is off, `app[appkeys.TRACING]` is
None, the handler looks at it once per call and goes its usual way, and no code of this module
is imported or runs.

When it is on, `Tracing` is that hook. Per proxied call it makes a `CallTrace`, which keeps
the server span named `{METHOD} {mount}`: it continues a `traceparent` from the request's
headers, or, for an MCP tool call, from `params._meta`, so for a POST to an MCP server the
span starts once the message is read (`CallTrace.continue_from`), from when the call arrived.
`TracedUpstreams` wraps each call to a tool (a session's handshake too) in a client span and
injects its `traceparent` into the headers the tool receives. The server span ends when the
answer is over (a session's, when the session is), with the fencing attributes of
`gateway.core.spans`: never a key, an injected credential or a body. A sampled trace's id
goes on the flow (`Flow.trace_id`), and from there on the receipt and the log line.

The standard `OTEL_*` variables configure it: the exporter (`OTEL_TRACES_EXPORTER`, default
`otlp`, over HTTP/protobuf; its endpoint, headers and timeout), the sampler, the batch
processor, the propagators and the resource (`service.name` defaults to `fence-gateway`).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from importlib.metadata import entry_points
from typing import Literal
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from opentelemetry import trace
from opentelemetry.propagate import get_global_textmap
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.config.policy import PolicySet, Upstream
from gateway.core import errors
from gateway.core.spans import call_attributes, decision_of, span_name
from gateway.proxy.flow import Flow
from gateway.proxy.headers import RECEIPT_HEADER
from gateway.proxy.upstream import UpgradeRefused, UpstreamFailure, Upstreams
from gateway.wire.answer import Answer

# What an MCP tool call's `params._meta` may carry of its trace (the W3C fields, as headers).
_META_FIELDS = ("traceparent", "tracestate", "baggage")
_EXPORTER_ALIASES = {"otlp": "otlp_proto_http"}  # the one OTLP transport the extra installs

_CURRENT: contextvars.ContextVar[CallTrace | None] = contextvars.ContextVar(
    "fence_gateway_call_trace", default=None
)
"""The call being handled in this task, for `TracedUpstreams` (cleanups and probes, which run
in the sweeper's task, have none)."""


class _HeaderGetter(Getter[Mapping[str, str]]):
    """Every line of a header, as W3C Trace Context reads them: several `tracestate` lines are
    one list (RFC 9110 §5.3); a `traceparent` sent more than once is invalid (none)."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        getall = getattr(carrier, "getall", None)
        if getall is not None:
            values = list(getall(key, []))
        else:
            value = carrier.get(key)
            values = [] if value is None else [value]
        if not values or (key == "traceparent" and len(values) > 1):
            return None
        return values

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier.keys())


_HEADERS = _HeaderGetter()


class TracingError(Exception):
    """`OTEL_TRACES_EXPORTER` names an exporter that is not installed."""


def exporter_classes(environ: Mapping[str, str] = os.environ) -> list[type[SpanExporter]]:
    """The span exporters `OTEL_TRACES_EXPORTER` names (comma-separated; `none`: none)."""
    names = [n.strip() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    chosen = []
    for name in filter(None, names):
        if name == "none":
            continue
        found = entry_points(
            group="opentelemetry_traces_exporter", name=_EXPORTER_ALIASES.get(name, name)
        )
        if not found:
            raise TracingError(
                f"OTEL_TRACES_EXPORTER: no span exporter {name!r} is installed "
                "(the otel extra brings otlp and console)"
            )
        chosen.append(next(iter(found)).load())
    return chosen


class Tracing:
    """The hook of an app that traces: its tracer provider, opened and shut down with it."""

    def __init__(self, policies: PolicySet) -> None:
        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "fence-gateway"}))
        self.provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER
        for exporter in exporter_classes():  # each reads its own OTEL_EXPORTER_* variables
            self.provider.add_span_processor(BatchSpanProcessor(exporter()))  # OTEL_BSP_*
        self.tracer = self.provider.get_tracer("fence-gateway")
        self.propagator = get_global_textmap()  # OTEL_PROPAGATORS, W3C trace context first
        self._policies = policies

    async def close(self) -> None:
        """Export what is left, off the event loop (a collector may be slow to take it)."""
        await asyncio.to_thread(self.provider.shutdown)

    def upstreams(self, upstreams: dict[str, Upstream]) -> Upstreams:
        return TracedUpstreams(upstreams)

    async def call(
        self,
        request: web.Request,
        flow: Flow,
        dispatch: Callable[[], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """`dispatch` (the rest of the call's handling) inside the call's server span."""
        call = CallTrace(self, request, flow)
        flow.trace = call
        token = _CURRENT.set(call)
        try:
            response = await dispatch()
        except errors.GatewayError as error:
            call.end(error.status, error.code, error.headers.get(RECEIPT_HEADER))
            raise
        except BaseException:
            call.end(None, "internal_error", None)
            raise
        finally:
            _CURRENT.reset(token)
        call.end(response.status, None, response.headers.get(RECEIPT_HEADER))
        return response

    def shed(self, method: str, target: str, headers: Mapping[str, str], status: int) -> None:
        """A call the overload limit answered from its parsed head, before anything else (no
        request object exists for it): a span that says so."""
        found = self._policies.route(target.partition("?")[0])
        mount = found[0].mount if found is not None else None
        attributes = {"http.request.method": method}
        if mount is not None:
            attributes["http.route"] = mount
        span = self.tracer.start_span(
            span_name(method, mount),
            context=self.propagator.extract(headers, getter=_HEADERS),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        decision = decision_of("overloaded", admitted=False, replayed=False)
        span.set_attributes(
            call_attributes(
                decision=decision,
                resource=None,
                fence=None,
                receipt_id=None,
                outcome=None,
                error_code="overloaded",
            )
        )
        span.set_attribute("http.response.status_code", status)
        span.set_status(Status(StatusCode.ERROR))
        span.end()


class CallTrace:
    """One proxied call's server span, started once its parent is known."""

    __slots__ = ("_flow", "_request", "_started_ns", "_tracing", "span")

    def __init__(self, tracing: Tracing, request: web.Request, flow: Flow) -> None:
        self._tracing, self._request, self._flow = tracing, request, flow
        self._started_ns = time.time_ns()
        self.span: trace.Span | None = None
        upstream = flow.upstream
        if upstream is None or not (upstream.mcp and request.method == "POST"):
            self._start(request.headers)

    def continue_from(self, meta: object) -> None:
        """An MCP tool call: its `params._meta` trace fields when it has them, else the
        headers'. Only the first call counts: a span's parent is set when it starts."""
        carrier = (
            {k: v for k in _META_FIELDS if isinstance(v := meta.get(k), str)}
            if isinstance(meta, dict)
            else {}
        )
        self._start(carrier if "traceparent" in carrier else self._request.headers)

    def _start(self, carrier: Mapping[str, str]) -> trace.Span:
        if self.span is not None:
            return self.span
        tracing, request, flow = self._tracing, self._request, self._flow
        mount = flow.upstream.mount if flow.upstream is not None else None
        self.span = span = tracing.tracer.start_span(
            span_name(request.method, mount),
            context=tracing.propagator.extract(carrier, getter=_HEADERS),
            kind=SpanKind.SERVER,
            attributes=_http_attributes(request, mount),
            start_time=self._started_ns,
        )
        context = span.get_span_context()
        if context.trace_flags.sampled:
            flow.trace_id = format(context.trace_id, "032x")
        return span

    def client_span(self, upstream: Upstream, method: str, headers: CIMultiDict[str]) -> trace.Span:
        """The call to the tool, a child of the server span; its `traceparent` goes into
        `headers`, replacing any the client sent (the tool's parent is this hop)."""
        parent = trace.set_span_in_context(self._start(self._request.headers))
        address = urlsplit(upstream.url)
        span = self._tracing.tracer.start_span(
            f"{method} {upstream.name}",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes={
                "http.request.method": method,
                "server.address": address.hostname or "",
                "server.port": address.port or (443 if address.scheme == "https" else 80),
                "fence_gateway.upstream": upstream.name,
            },
        )
        # a tracestate belongs to the traceparent it came with, which the tool does not get
        if "tracestate" in self._tracing.propagator.fields:
            headers.popall("tracestate", None)
        self._tracing.propagator.inject(headers, context=trace.set_span_in_context(span))
        return span

    def end(self, status: int | None, error_code: str | None, receipt_id: str | None) -> None:
        span = self._start(self._request.headers)
        flow = self._flow
        span.set_attributes(
            call_attributes(
                decision=decision_of(error_code, flow.admitted is not None, flow.replayed),
                resource=flow.resource,
                fence=flow.fence,
                receipt_id=receipt_id or flow.receipt_id,
                outcome=flow.outcome,
                error_code=error_code,
            )
        )
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if status is None or status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()


class TracedUpstreams(Upstreams):
    """`Upstreams` whose calls made for a traced proxied call are client spans."""

    async def send(
        self,
        upstream: Upstream,
        method: str,
        rest: str,
        headers: CIMultiDict[str],
        body: bytes | None,
        deadline: float,
        may_send: Callable[[], bool] | None = None,
    ) -> Answer:
        call = _CURRENT.get()
        if call is None:  # a call the gateway makes itself
            return await super().send(upstream, method, rest, headers, body, deadline, may_send)
        span = call.client_span(upstream, method, headers)
        try:
            answer = await super().send(upstream, method, rest, headers, body, deadline, may_send)
        except BaseException as exc:
            _failed(span, exc)
            raise
        _answered(span, answer.status)  # at the answer's head, as HTTP clients' spans end
        return answer

    async def open_websocket(
        self,
        upstream: Upstream,
        rest: str,
        headers: CIMultiDict[str],
        protocols: tuple[str, ...],
        deadline: float,
        may_send: Callable[[], bool] | None = None,
    ) -> aiohttp.ClientWebSocketResponse[Literal[False]]:
        """A session's upgrade (docs/contract.md §15): the client span is its handshake."""
        call = _CURRENT.get()
        if call is None:
            return await super().open_websocket(
                upstream, rest, headers, protocols, deadline, may_send
            )
        span = call.client_span(upstream, "GET", headers)
        try:
            socket = await super().open_websocket(
                upstream, rest, headers, protocols, deadline, may_send
            )
        except UpgradeRefused as refused:
            _answered(span, refused.status)
            raise
        except BaseException as exc:
            _failed(span, exc)
            raise
        _answered(span, 101)
        return socket


def _answered(span: trace.Span, status: int) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def _failed(span: trace.Span, exc: BaseException) -> None:
    """End a client span whose call to the tool failed: the gateway's code when it has one."""
    if isinstance(exc, UpstreamFailure):
        span.set_attribute("error.type", exc.error.code)
    span.set_status(Status(StatusCode.ERROR))
    span.end()


def _http_attributes(request: web.Request, mount: str | None) -> dict[str, str]:
    attributes = {"http.request.method": request.method, "url.scheme": request.scheme}
    if mount is not None:
        attributes["http.route"] = mount
    return attributes
