"""The one place errors become answers: problem+json (RFC 9457) for every error the gateway
makes, and one log line for every fenced call and every rejection."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.core import errors
from gateway.core import mcp as mcp_decisions
from gateway.observe import logs
from gateway.proxy import appkeys, headers, mcp

PROBLEM_TYPE = "application/problem+json"

# aiohttp's own refusals (router, body limits), in the gateway's vocabulary.
_HTTP_EXCEPTIONS: dict[int, type[errors.GatewayError]] = {
    404: errors.NotFound,
    405: errors.MethodNotAllowed,
    413: errors.BodyTooLarge,
    408: errors.RequestTimeout,
    431: errors.HeadersTooLarge,
}


def problem_document(
    error: errors.GatewayError, request_id: str | None, presented: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The RFC 9457 problem object of `error`."""
    document: dict[str, Any] = {
        "type": f"urn:fence-gateway:{error.code}",
        "title": error.title,
        "status": error.status,
        "code": error.code,
        "detail": error.detail,
    }
    for name in ("resource", "fence"):
        if presented and presented.get(name) is not None:
            document[name] = presented[name]
    document["request_id"] = request_id
    document.update(error.extra)
    return document


def problem_response(
    error: errors.GatewayError, request_id: str | None, presented: dict[str, Any] | None = None
) -> web.Response:
    document = problem_document(error, request_id, presented)
    response = web.Response(
        status=error.status, text=json.dumps(document), content_type=PROBLEM_TYPE
    )
    return _with_error_headers(response, error, request_id)


def jsonrpc_error_response(
    error: errors.GatewayError,
    request_id: str | None,
    presented: dict[str, Any] | None,
    jsonrpc_id: str | int | None,
) -> web.Response:
    """The same refusal for an MCP client (docs/contract.md §16): the HTTP status of §5, a
    JSON-RPC error with the request's id and the problem object as its `data`."""
    document = problem_document(error, request_id, presented)
    response = web.Response(
        status=error.status,
        body=mcp_decisions.error_response(jsonrpc_id, document),
        content_type="application/json",
    )
    return _with_error_headers(response, error, request_id)


def _with_error_headers(
    response: web.Response, error: errors.GatewayError, request_id: str | None
) -> web.Response:
    response.headers.update(error.headers)
    if request_id:
        response.headers[headers.REQUEST_ID_HEADER] = request_id
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(error.retry_after)
    return response


def error_response(
    request: web.Request,
    error: errors.GatewayError,
    request_id: str | None,
    presented: dict[str, Any] | None = None,
) -> web.Response:
    """A refusal in the caller's protocol: a JSON-RPC error to an MCP client's POST (with the
    message's id once its body was read), problem+json to everyone else."""
    if mcp.answers_in_jsonrpc(request):
        jsonrpc_id = request.get(appkeys.JSONRPC_ID)
        return jsonrpc_error_response(error, request_id, presented, jsonrpc_id)
    return problem_response(error, request_id, presented)


@web.middleware
async def problems(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = time.perf_counter()
    request_id = headers.request_id(request.headers) or headers.new_request_id()
    request[appkeys.REQUEST_ID] = request_id
    error: errors.GatewayError | None = None
    try:
        response = await handler(request)
    except errors.GatewayError as exc:
        error = exc
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = _HTTP_EXCEPTIONS.get(exc.status, errors.InvalidRequest)(exc.reason)
        if request.method == "CONNECT":  # an authority-form target matches no route at all
            error = errors.MethodNotAllowed("CONNECT is not proxied")
    except Exception:  # a bug: answer cleanly, keep the trace in the log only
        logs.log.exception("unhandled error on %s %s", request.method, request.path)
        error = errors.GatewayError("the gateway failed unexpectedly; see its log")
    flow = request.get(appkeys.FLOW)
    fields = flow.log_fields() if flow is not None else None
    replayed = flow is not None and flow.replayed
    if error is not None:
        response = error_response(request, error, request_id, fields)
    if not request.path.startswith("/_gateway/"):
        _count(request, error, fields or {}, replayed)
    if fields is not None or (error is not None and not request.path.startswith("/_gateway/")):
        _log(request, response, error, request_id, fields or {}, replayed, started)
    return response


# Failures of the call itself, as opposed to the gateway refusing it.
_ERROR_CODES = frozenset(
    {
        "upstream_unreachable",
        "upstream_outcome_unknown",
        "upstream_timeout",
        "store_unavailable",
        "internal_error",
    }
)


def _count(
    request: web.Request, error: errors.GatewayError | None, fields: dict[str, Any], replayed: bool
) -> None:
    """fence_gateway_requests_total and _rejections_total for every proxied call: counted
    here only, so that no refusal, wherever it happens, goes uncounted."""
    metrics = request.app[appkeys.METRICS]
    upstream = str(fields.get("upstream") or "-")  # "-": refused before it was routed
    if error is None:
        result = "replayed" if replayed else "forwarded"
    elif error.code in _ERROR_CODES:
        result = "error"
    else:
        result = "rejected"
        metrics.rejections_of(upstream, error.code).inc()
    metrics.requests_of(upstream, result).inc()


def _log(
    request: web.Request,
    response: web.StreamResponse,
    error: errors.GatewayError | None,
    request_id: str,
    fields: dict[str, Any],
    replayed: bool,
    started: float,
) -> None:
    level = logging.WARNING if error is not None and error.status >= 500 else logging.INFO
    if not logs.log.isEnabledFor(level):
        return  # the line would be dropped: do not build it
    session = fields.get("kind") == "session"
    logs.event(
        "rejected"
        if error is not None
        else "replayed"
        if replayed
        else "session"
        if session
        else "call",
        level,
        request_id=request_id,
        receipt_id=fields.get("receipt_id") or response.headers.get(headers.RECEIPT_HEADER),
        client=fields.get("client"),
        resource=fields.get("resource"),
        fence=fields.get("fence"),
        upstream=fields.get("upstream"),
        method=request.method,
        path=request.path,
        status=response.status,
        code=error.code if error is not None else None,
        duration_ms=round((time.perf_counter() - started) * 1000, 2),
        trace_id=fields.get("trace_id"),  # docs/contract.md §21: when a sampled span traced it
        # a session's end (docs/contract.md §15): closed_by, close_code and its counts
        **(fields.get("session_end") or {}),
    )
