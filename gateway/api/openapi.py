"""`GET /_gateway/v1/openapi.json`: the OpenAPI 3.1 description of /_gateway/v1
(docs/contract.md §10).

Written out by hand from the contract rather than generated: the API is small and the document is
the contract reconciler authors read. A test checks that every route the app serves under
/_gateway/v1 is described here, and nothing more.
"""

from __future__ import annotations

import re
from typing import Any, get_args

from aiohttp import web

from gateway.api import checkpoints, fences, params, receipts
from gateway.config.policy import PolicySet
from gateway.core import checkpoints as checkpoint_rules
from gateway.core import errors, grammar
from gateway.core.errors import BY_CODE
from gateway.core.leases import LEASE_STATES, SWEEPER_OWNER_PREFIX
from gateway.core.receipts import RECEIPT_STATUSES, RESOLUTIONS, Kind
from gateway.proxy import appkeys

routes = web.RouteTableDef()

# What each parameter's schema admits is exactly what the gateway accepts: a contract tester
# (schemathesis) sends whatever a schema admits and expects it served, and sends what it does
# not admit and expects `400`. So the patterns below are the grammar's own rules
# (`gateway.core.grammar`, `gateway.api.params`, `gateway.api.receipts`), written as regular
# expressions; tests/unit/test_openapi.py holds each against the check it states.
_NAME_CHAR = r"[A-Za-z0-9._\-:@]"
_NOT_DOT = r"[A-Za-z0-9_\-:@]"
# one segment of a resource key: its characters, but not "." or ".."
_SEGMENT = rf"(?:{_NOT_DOT}{_NAME_CHAR}*|\.{_NOT_DOT}{_NAME_CHAR}*|\.\.{_NAME_CHAR}+)"
RESOURCE_PATTERN = rf"^{_SEGMENT}(?:/{_SEGMENT})*$"
# A resource glob (docs/contract.md §18's raises): the same with `*` among the characters
# (a segment of stars is never "." or ".."); `gateway.api.fences` allows 256 characters.
_GLOB_CHAR = r"[A-Za-z0-9._\-:@*]"
_GLOB_NOT_DOT = r"[A-Za-z0-9_\-:@*]"
_GLOB_SEGMENT = (
    rf"(?:{_GLOB_NOT_DOT}{_GLOB_CHAR}*|\.{_GLOB_NOT_DOT}{_GLOB_CHAR}*|\.\.{_GLOB_CHAR}+)"
)
GLOB_PATTERN = rf"^{_GLOB_SEGMENT}(?:/{_GLOB_SEGMENT})*$"
OWNER_PATTERN = r"^[A-Za-z0-9._\-:@/]{1,128}$"
CLIENT_KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"
NO_NUL = {"type": "string", "pattern": r"^[^\x00]*$"}  # gateway.api.params.only

_TIME = {"type": ["string", "null"], "format": "date-time"}
_RESOURCE = {
    "name": "resource",
    "in": "path",
    "required": True,
    "description": "The resource key; it keeps its slashes.",
    "schema": {
        "type": "string",
        "minLength": 1,
        "maxLength": 256,
        "pattern": RESOURCE_PATTERN,
    },
}
_RECEIPT_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_OWNER = {"type": "string", "pattern": OWNER_PATTERN}
_FENCE = {"type": "integer", "minimum": 1, "maximum": grammar.MAX_FENCE}


def _query(name: str, schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": schema,
        "description": description,
    }


_PAGING = [
    _query("limit", {"type": "integer", "minimum": 1, "maximum": params.MAX_LIMIT, "default": 100}),
    _query(
        "cursor",
        {"type": "string", "pattern": params.CURSOR_PATTERN},
        "next_cursor of the previous page (opaque: pass it on as it came)",
    ),
]

# DELETE /leases/{resource} is a release (owner and fence) or a revoke (force=true, nothing
# else): one query object with two shapes, since OpenAPI has no dependencies between
# separate parameters.
_RELEASE_OR_REVOKE = {
    "name": "release",
    "in": "query",
    "required": True,
    "style": "form",
    "explode": True,
    "description": "owner and fence to release the lease you hold; force=true alone to revoke "
    "anyone's (admin)",
    "schema": {
        "oneOf": [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["owner", "fence"],
                "properties": {
                    "owner": _OWNER,
                    "fence": _FENCE,
                    "force": {"type": "string", "enum": ["false"]},
                },
            },
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["force"],
                "properties": {"force": {"type": "string", "enum": ["true"]}},
            },
        ]
    },
}

_SCHEMAS: dict[str, Any] = {
    "Problem": {
        "type": "object",
        "required": ["type", "title", "status", "code", "detail"],
        "properties": {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "code": {"type": "string", "enum": sorted(BY_CODE)},
            "resource": {"type": "string"},
            "fence": {"type": "integer"},
            "request_id": {"type": "string"},
            "receipt_id": {"type": "string"},
            "holder": {"type": "string"},
            "expires_at": _TIME,
        },
    },
    "Lease": {
        "type": "object",
        "required": [
            "resource",
            "owner",
            "fence",
            "state",
            "acquired_at",
            "renewed_at",
            "expires_at",
        ],
        "properties": {
            "resource": {"type": "string"},
            "owner": {"type": "string"},
            "fence": {"type": "integer", "minimum": 1},
            "state": {"type": "string", "enum": list(LEASE_STATES)},
            "acquired_at": _TIME,
            "renewed_at": _TIME,
            "expires_at": _TIME,
        },
    },
    "Receipt": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "resource": {"type": "string"},
            "fence": {"type": "integer"},
            "owner": {"type": ["string", "null"]},
            "client": {"type": ["string", "null"]},
            "upstream": {"type": "string"},
            "method": {"type": "string"},
            "path": {"type": "string"},
            "idempotency_key": {"type": ["string", "null"]},
            "fingerprint": {"type": ["string", "null"]},
            "attempt": {"type": ["integer", "null"]},
            "status": {
                "type": "string",
                "enum": list(RECEIPT_STATUSES),
            },
            "http_status": {"type": ["integer", "null"]},
            "error": {"type": ["string", "null"]},
            "reject_code": {"type": ["string", "null"]},
            "late": {"type": "boolean"},
            "created_at": _TIME,
            "forwarded_at": _TIME,
            "completed_at": _TIME,
            "instance": {"type": "string"},
            "kind": {"type": "string", "enum": list(get_args(Kind))},
            "session": {
                "oneOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "properties": {
                            "opened_at": _TIME,
                            "closed_at": _TIME,
                            "closed_by": {"type": ["string", "null"]},
                            "close_code": {"type": ["integer", "null"]},
                            "messages_in": {"type": "integer"},
                            "messages_out": {"type": "integer"},
                            "bytes_in": {"type": "integer"},
                            "bytes_out": {"type": "integer"},
                        },
                    },
                ]
            },
            "mcp": {
                "description": "an MCP tool call's tool and JSON-RPC id (docs/contract.md §16)",
                "oneOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "required": ["tool", "jsonrpc_id"],
                        "properties": {
                            "tool": {"type": "string"},
                            "jsonrpc_id": {"type": ["string", "integer"]},
                        },
                    },
                ],
            },
            "trace_id": {
                "description": "the call's trace, when the gateway's span of it was sampled "
                "(docs/contract.md §21)",
                "type": ["string", "null"],
                "pattern": "^[0-9a-f]{32}$",
            },
            "resolution": {
                "oneOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "properties": {
                            "outcome": {"type": "string", "enum": list(RESOLUTIONS)},
                            "source": {"type": "string"},
                            "note": {"type": ["string", "null"]},
                            "at": _TIME,
                        },
                    },
                ]
            },
        },
    },
}


_SCHEMAS["Checkpoint"] = {
    "type": "object",
    "required": ["resource", "seq", "fence", "owner", "client", "step", "state", "at"],
    "properties": {
        "resource": {"type": "string"},
        "seq": {"type": "integer", "minimum": 1},
        "fence": {"type": "integer", "minimum": 1},
        "owner": {"type": ["string", "null"]},
        "client": {"type": ["string", "null"]},
        "step": {"type": "string"},
        "state": {"description": "any JSON, as the owner wrote it"},
        "at": _TIME,
    },
}
_SCHEMAS["RunView"] = {
    "type": "object",
    "required": ["resource", "state", "lease", "checkpoint", "since_checkpoint"],
    "properties": {
        "resource": {"type": "string"},
        "state": {
            "type": "string",
            "enum": [
                "lease_valid",
                "lease_lost",
                "outcome_unknown",
                "reconciliation_required",
                "idle",
            ],
        },
        "lease": {"oneOf": [{"type": "null"}, {"$ref": "#/components/schemas/Lease"}]},
        "highest_fence": {
            "type": "integer",
            "minimum": 0,
            "description": "not shown to agents (docs/contract.md §5)",
        },
        "checkpoint": {"oneOf": [{"type": "null"}, {"$ref": "#/components/schemas/Checkpoint"}]},
        "since_checkpoint": {
            "type": "object",
            "required": ["completed", "needs_confirmation", "rejected"],
            "properties": {
                "completed": {"type": "array", "items": {"$ref": "#/components/schemas/Receipt"}},
                "needs_confirmation": {
                    "type": "array",
                    "items": {"$ref": "#/components/schemas/Receipt"},
                },
                "rejected": {"type": "integer", "minimum": 0},
            },
        },
    },
}


def _page_of(name: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["items", "next_cursor"],
        "properties": {
            "items": {"type": "array", "items": _ref(name)},
            "next_cursor": {"type": ["string", "null"]},
        },
    }


def _answer(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    if schema is None:
        return {"description": description}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


_PROBLEM = {
    "description": "An error (problem+json, RFC 9457)",
    "content": {"application/problem+json": {"schema": _ref("Problem")}},
}


def _op(
    summary: str,
    responses: dict[str, Any],
    parameters: list[dict[str, Any]] | None = None,
    body: dict[str, Any] | None = None,
    body_required: bool = True,
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "parameters": parameters or [],
        "responses": {**responses, "default": _PROBLEM},
    }
    if body is not None:
        operation["requestBody"] = {
            "required": body_required,
            "content": {"application/json": {"schema": body}},
        }
    return operation


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": required,
        "properties": properties,
    }


def _ttl(policies: PolicySet | None) -> dict[str, Any]:
    """`ttl_s`: above 0 and at most the rule's `lease.max_ttl_s`. One document serves every
    resource, so it states the smallest maximum among this gateway's rules: a value it admits
    is accepted for any resource."""
    schema: dict[str, Any] = {"type": "number", "exclusiveMinimum": 0}
    maxima = [
        rule.lease.max_ttl_s
        for rule in (policies.rules if policies is not None else [])
        if rule.lease.issuer == "gateway"
    ]
    if maxima:
        schema["maximum"] = min(maxima)
    return schema


_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "Makes a retried acquire answer the same lease (docs/contract.md §6)",
    # the gateway's own keys start with gw-; a client's may not
    "schema": {"type": "string", "pattern": CLIENT_KEY_PATTERN, "not": {"pattern": "^gw-"}},
}


# A checkpoint's fencing headers (docs/contract.md §17, as for a call: §3).
_FENCING_HEADERS = [
    {
        "name": "X-Fence-Token",
        "in": "header",
        "required": True,
        "schema": {"type": "integer", "minimum": 1, "maximum": grammar.MAX_FENCE},
    },
    {"name": "X-Lease-Owner", "in": "header", "required": False, "schema": _OWNER},
    {
        "name": "X-Fence-Signature",
        "in": "header",
        "required": False,
        "description": "for a rule whose external issuer signs its fences",
        "schema": {"type": "string"},
    },
]


def _paths(ttl_s: dict[str, Any]) -> dict[str, Any]:
    lease = _answer("The lease", _ref("Lease"))
    receipt = _answer("The receipt", _ref("Receipt"))
    receipts_page = _answer("A page of receipts", _page_of("Receipt"))
    return {
        "/_gateway/v1/leases": {
            "get": _op(
                "List leases",
                {"200": _answer("A page of leases", _page_of("Lease"))},
                [
                    _query("prefix", NO_NUL),
                    _query("state", {"type": "string", "enum": list(LEASE_STATES)}),
                    *_PAGING,
                ],
            )
        },
        "/_gateway/v1/leases/{resource}": {
            "parameters": [_RESOURCE],
            "post": _op(
                "Acquire (compare-and-swap); a new fence",
                {
                    "201": lease,
                    "200": _answer("A retried acquire (same Idempotency-Key)", _ref("Lease")),
                },
                [_IDEMPOTENCY_KEY],
                body=_object(
                    ["owner"],
                    owner={**_OWNER, "not": {"pattern": f"^{SWEEPER_OWNER_PREFIX}"}},
                    ttl_s=ttl_s,
                ),
            ),
            "put": _op(
                "Renew",
                {"200": lease},
                body=_object(["owner", "fence"], owner=_OWNER, fence=_FENCE, ttl_s=ttl_s),
            ),
            "delete": _op(
                "Release (owner and fence) or revoke (force=true)",
                {"204": _answer("Released")},
                [_RELEASE_OR_REVOKE],
            ),
            "get": _op("Read one lease", {"200": lease}),
        },
        "/_gateway/v1/receipts": {
            "get": _op(
                "List receipts, oldest first",
                {"200": receipts_page},
                [
                    *(_query(n, NO_NUL) for n in ("resource", "owner")),
                    _query("status", {"type": "string", "enum": list(RECEIPT_STATUSES)}),
                    _query("idempotency_key", NO_NUL),
                    *(
                        _query(n, {"type": "integer", "minimum": 0, "maximum": grammar.MAX_FENCE})
                        for n in ("fence_min", "fence_max")
                    ),
                    _query("since", {"type": "string", "format": "date-time"}, "inclusive"),
                    _query("until", {"type": "string", "format": "date-time"}, "exclusive"),
                    *_PAGING,
                ],
            )
        },
        "/_gateway/v1/receipts/{id}": {
            "parameters": [_RECEIPT_ID],
            "get": _op("Read one receipt", {"200": receipt}),
        },
        "/_gateway/v1/receipts/{id}/resolve": {
            "parameters": [_RECEIPT_ID],
            "post": _op(
                "Reconcile an outcome_unknown receipt past its grace",
                {"200": receipt},
                body=_object(
                    ["outcome", "source"],
                    outcome={"type": "string", "enum": list(RESOLUTIONS)},
                    source={
                        "type": "string",
                        "maxLength": receipts.MAX_SOURCE,
                        "pattern": receipts.SOURCE_PATTERN,
                        "description": "who decided: operator:NAME, service:NAME",
                    },
                    note={
                        "type": ["string", "null"],
                        "maxLength": receipts.MAX_NOTE,
                        "pattern": receipts.NOTE_PATTERN,
                    },
                ),
            ),
        },
        "/_gateway/v1/receipts/{id}/probe": {
            "parameters": [_RECEIPT_ID],
            "post": _op(
                "Ask the upstream through the rule's probe",
                {"200": receipt},
                body=_object([]),
                body_required=False,
            ),
        },
        "/_gateway/v1/reconciliation": {
            "get": _op(
                "The outcome_unknown receipts, oldest first", {"200": receipts_page}, _PAGING
            )
        },
        "/_gateway/v1/checkpoints/{resource}": {
            "parameters": [_RESOURCE],
            "put": _op(
                "Write a checkpoint (the current owner only; moves no fence)",
                {
                    "201": _answer("The checkpoint appended", _ref("Checkpoint")),
                    "200": _answer(
                        "An identical retry: the latest checkpoint, nothing appended",
                        _ref("Checkpoint"),
                    ),
                },
                _FENCING_HEADERS,
                body=_object(
                    ["step", "state"],
                    step={
                        "type": "string",
                        "pattern": checkpoint_rules.STEP_PATTERN,
                        "description": "1 to 128 characters, no control characters",
                    },
                    state={
                        "description": "any JSON, at most "
                        f"{checkpoint_rules.MAX_STATE_BYTES} bytes as compact JSON"
                    },
                ),
            ),
            "get": _op(
                "The resource's checkpoints, newest first",
                {"200": _answer("A page of checkpoints", _page_of("Checkpoint"))},
                [
                    _PAGING[0],
                    _query(
                        "cursor",
                        {"type": "string", "pattern": checkpoints.CURSOR_PATTERN},
                        "next_cursor of the previous page (opaque: pass it on as it came)",
                    ),
                ],
            ),
        },
        "/_gateway/v1/resources/{resource}": {
            "parameters": [_RESOURCE],
            "get": _op(
                "The run view: lease, last checkpoint, the calls since it",
                {"200": _answer("The run view", _ref("RunView"))},
            ),
        },
        "/_gateway/v1/fences/raise": {
            "post": _op(
                "Raise every resource a glob covers, known now or first seen later (admin)",
                {
                    "200": _answer(
                        "Raised; known_resources: how many known resources it covered",
                        _object(
                            ["match", "at_least", "known_resources"],
                            match={"type": "string"},
                            at_least=_FENCE,
                            known_resources={"type": "integer", "minimum": 0},
                        ),
                    )
                },
                body=_object(
                    ["match", "at_least"],
                    match={
                        "type": "string",
                        "minLength": 1,
                        "maxLength": fences.MAX_GLOB,
                        "pattern": GLOB_PATTERN,
                    },
                    at_least=_FENCE,
                ),
            )
        },
        "/_gateway/v1/fences/{resource}": {
            "parameters": [_RESOURCE],
            "put": _op(
                "Raise one resource's highest accepted fence, never lowering it; lifts its "
                "hold after a restore (admin)",
                {
                    "200": _answer(
                        "The resource's highest accepted fence now",
                        _object(
                            ["resource", "highest_fence"],
                            resource={"type": "string"},
                            highest_fence=_FENCE,
                        ),
                    )
                },
                body=_object(["at_least"], at_least=_FENCE),
            ),
        },
        "/_gateway/v1/openapi.json": {
            "get": _op("This document", {"200": _answer("OpenAPI 3.1", {"type": "object"})})
        },
    }


def document(policies: PolicySet | None = None, secured: bool = True) -> dict[str, Any]:
    """The document of this gateway: `secured` when it has a clients file (a bearer key on
    every call; docs/contract.md §10), without security when it runs open; `ttl_s` bounded by
    its policies' rules."""
    described: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "fence-gateway",
            "version": "1",
            "description": "Leases, receipts and reconciliation of a fencing proxy."
            + ("" if secured else " This gateway runs without a clients file: open to all."),
        },
        "paths": _paths(_ttl(policies)),
        "components": {"schemas": _SCHEMAS},
    }
    if secured:
        described["components"]["securitySchemes"] = {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "A client's key, from the gateway's clients file",
            }
        }
        described["security"] = [{"bearer": []}]
    return described


@routes.get("/_gateway/v1/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    app = request.app
    return web.json_response(document(app[appkeys.POLICIES], app[appkeys.CLIENTS] is not None))


def allowed_methods(path: str) -> list[str] | None:
    """The methods the document gives a concrete /_gateway/v1 path, HEAD with GET; None when
    it describes no such path."""
    for pattern, methods in _ALLOWED:
        if pattern.fullmatch(path):
            return list(methods)
    return None


def _parameter_pattern(match: re.Match[str]) -> str:
    return ".+" if match.group(1) == "resource" else "[^/]+"


def _allowed(item: dict[str, Any]) -> list[str]:
    methods = sorted(m.upper() for m in item if m != "parameters")
    return sorted({*methods, "HEAD"}) if "GET" in methods else methods


# Each path of the document as a pattern, with its methods: worked out once, not per refusal.
# {resource} keeps its slashes, other parameters are one segment (as routed).
_ALLOWED = [
    (re.compile(re.sub(r"\\\{(\w+)\\\}", _parameter_pattern, re.escape(template))), _allowed(item))
    for template, item in _paths({}).items()
]


# Registered after every /_gateway/v1 route (its module's routes are added last): a method the
# document does not give a path is `405` with `Allow`, as HTTP says, not the catch-all's `404`.
@routes.route("*", "/_gateway/v1/{tail:.*}")
async def method_not_allowed(request: web.Request) -> web.Response:
    allowed = allowed_methods(request.path)
    if allowed is None:
        raise errors.NotFound(f"no gateway endpoint {request.method} {request.path}")
    raise errors.MethodNotAllowed(
        f"{request.path} takes {', '.join(allowed)}, not {request.method}",
        headers={"Allow": ", ".join(allowed)},
    )
