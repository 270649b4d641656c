"""A real OTLP/HTTP receiver for the tracing tests: an aiohttp server on loopback that takes
what an exporter POSTs to `/v1/traces` and decodes it with `opentelemetry-proto` (the package
the OTLP exporter itself depends on), so the tests read the spans the gateway sent over the
wire, not a tracer's memory."""

from __future__ import annotations

import dataclasses
import gzip
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.harness import wait_for

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    name: str
    kind: int
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    service: str


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    return None if which is None else getattr(value, which)


class OtlpReceiver:
    """`async with OtlpReceiver() as otlp:` then `OTEL_EXPORTER_OTLP_ENDPOINT=otlp.url`."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> OtlpReceiver:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        self.requests += 1
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            status_code=span.status.code,
                            service=str(resource.get("service.name")),
                        )
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def of_kind(self, kind: int) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.kind == kind]

    async def wait_spans(self, kind: int, count: int, timeout: float = 10.0) -> list[ReceivedSpan]:
        """The first `count` spans of `kind`, once they arrived."""
        await wait_for(
            lambda: len(self.of_kind(kind)) >= count,
            timeout=timeout,
            what=f"{count} spans of kind {kind} at the OTLP receiver",
        )
        return self.of_kind(kind)[:count]


def tracing_env(otlp: OtlpReceiver) -> dict[str, str]:
    """What a gateway that traces to `otlp` is started with: the standard variables only,
    the batch processor exporting every 50 ms so a test does not wait for its 5 s default."""
    return {
        "GATEWAY_OTEL": "true",
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "gateway-under-test",
    }
