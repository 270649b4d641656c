"""`GET /_gateway/v1/openapi.json`: the OpenAPI 3.1 description of /_gateway/v1
(docs/contract.md §10).

Written out by hand from the contract rather than generated: the API is small and the document is
the contract reconciler authors read. A test checks that every route the app serves under
/_gateway/v1 is described here, and nothing more.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.core.errors import BY_CODE

routes = web.RouteTableDef()

_TIME = {"type": ["string", "null"], "format": "date-time"}
_RESOURCE = {
    "name": "resource",
    "in": "path",
    "required": True,
    "description": "The resource key; it keeps its slashes.",
    "schema": {"type": "string", "pattern": r"^[A-Za-z0-9._\-:@/]{1,256}$"},
}
_RECEIPT_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}


def _query(name: str, schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": schema,
        "description": description,
    }


_PAGING = [
    _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}),
    _query("cursor", {"type": "string"}, "next_cursor of the previous page"),
]

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
            "state": {"type": "string", "enum": ["held", "expired", "released"]},
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
                "enum": [
                    "pending",
                    "succeeded",
                    "failed",
                    "not_sent",
                    "outcome_unknown",
                    "rejected",
                    "reconciled",
                ],
            },
            "http_status": {"type": ["integer", "null"]},
            "error": {"type": ["string", "null"]},
            "reject_code": {"type": ["string", "null"]},
            "late": {"type": "boolean"},
            "created_at": _TIME,
            "forwarded_at": _TIME,
            "completed_at": _TIME,
            "instance": {"type": "string"},
            "resolution": {
                "oneOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "properties": {
                            "outcome": {
                                "type": "string",
                                "enum": ["applied", "not_applied", "compensated"],
                            },
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


def _page_of(name: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["items", "next_cursor"],
        "properties": {
            "items": {"type": "array", "items": {"$ref": f"#/components/schemas/{name}"}},
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
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "parameters": parameters or [],
        "responses": {**responses, "default": _PROBLEM},
    }
    if body is not None:
        operation["requestBody"] = {
            "required": True,
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


def document() -> dict[str, Any]:
    lease = _answer("The lease", _ref("Lease"))
    receipt = _answer("The receipt", _ref("Receipt"))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "fence-gateway",
            "version": "1",
            "description": "Leases, receipts and reconciliation of a fencing proxy.",
        },
        "paths": {
            "/_gateway/v1/leases": {
                "get": _op(
                    "List leases",
                    {"200": _answer("A page of leases", _page_of("Lease"))},
                    [
                        _query("prefix", {"type": "string"}),
                        _query(
                            "state", {"type": "string", "enum": ["held", "expired", "released"]}
                        ),
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
                    body=_object(
                        ["owner"],
                        owner={"type": "string"},
                        ttl_s={"type": "number", "exclusiveMinimum": 0},
                    ),
                ),
                "put": _op(
                    "Renew",
                    {"200": lease},
                    body=_object(
                        ["owner", "fence"],
                        owner={"type": "string"},
                        fence={"type": "integer", "minimum": 1},
                        ttl_s={"type": "number", "exclusiveMinimum": 0},
                    ),
                ),
                "delete": _op(
                    "Release (owner and fence) or revoke (force=true)",
                    {"204": _answer("Released")},
                    [
                        _query("owner", {"type": "string"}),
                        _query("fence", {"type": "integer", "minimum": 1}),
                        _query("force", {"type": "boolean"}),
                    ],
                ),
                "get": _op("Read one lease", {"200": lease}),
            },
            "/_gateway/v1/receipts": {
                "get": _op(
                    "List receipts, oldest first",
                    {"200": _answer("A page of receipts", _page_of("Receipt"))},
                    [
                        *(
                            _query(n, {"type": "string"})
                            for n in ("resource", "status", "owner", "idempotency_key")
                        ),
                        _query("fence_min", {"type": "integer"}),
                        _query("fence_max", {"type": "integer"}),
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
                        outcome={
                            "type": "string",
                            "enum": ["applied", "not_applied", "compensated"],
                        },
                        source={"type": "string", "minLength": 1},
                        note={"type": ["string", "null"]},
                    ),
                ),
            },
            "/_gateway/v1/receipts/{id}/probe": {
                "parameters": [_RECEIPT_ID],
                "post": _op("Ask the upstream through the rule's probe", {"200": receipt}),
            },
            "/_gateway/v1/reconciliation": {
                "get": _op(
                    "The outcome_unknown receipts, oldest first",
                    {"200": _answer("A page of receipts", _page_of("Receipt"))},
                    _PAGING,
                )
            },
            "/_gateway/v1/openapi.json": {
                "get": _op("This document", {"200": _answer("OpenAPI 3.1")})
            },
        },
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A client's key, when the gateway has a clients file",
                }
            },
        },
        "security": [{"bearer": []}],
    }


@routes.get("/_gateway/v1/openapi.json")
async def openapi(_request: web.Request) -> web.Response:
    return web.json_response(document())
