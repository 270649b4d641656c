"""Raising fences (docs/contract.md §18), admin only: after a restore, to let an external
issuer's resources off hold at its current value, or whenever a token is known to have leaked.

`PUT /_gateway/v1/fences/{resource}` raises one resource; `POST /_gateway/v1/fences/raise`
raises every resource a glob covers, known now or first seen later. Neither ever lowers a
fence. The role check is `gateway.server.auth`'s; the store makes the change atomically.
"""

from __future__ import annotations

from aiohttp import web

from gateway.api import params
from gateway.core import errors, grammar
from gateway.core.globs import valid_glob
from gateway.observe import logs
from gateway.proxy import appkeys, headers
from gateway.proxy.flow import Flow

MAX_GLOB = 256  # characters of a raise's `match`, as many as a resource key may have

routes = web.RouteTableDef()


@routes.post("/_gateway/v1/fences/raise")
async def raise_matching(request: web.Request) -> web.Response:
    params.only(request, ())
    body = await params.json_body(request, {"match": str, "at_least": int}, ("match", "at_least"))
    match = body["match"]
    if len(match) > MAX_GLOB or not valid_glob(match):
        raise errors.InvalidRequest(
            f"match {match!r} is not a resource glob: up to {MAX_GLOB} characters, a resource "
            "key whose segments may hold * (within a segment) or ** (across segments)"
        )
    at_least = _at_least(body["at_least"])
    known = await request.app[appkeys.STORE].raise_fences(match, at_least)
    logs.event(
        "fences_raised",
        match=match,
        at_least=at_least,
        known_resources=known,
        client=_client(request),
    )
    return web.json_response({"match": match, "at_least": at_least, "known_resources": known})


@routes.put("/_gateway/v1/fences/{resource:.+}")
async def raise_one(request: web.Request) -> web.Response:
    params.only(request, ())
    resource = request.match_info["resource"]
    if resource == "raise":
        # the concrete path /_gateway/v1/fences/raise is matched before the templated one
        # (OpenAPI 3.1 "Paths"): the document gives it POST alone
        raise errors.MethodNotAllowed(
            "/_gateway/v1/fences/raise takes POST, not PUT", headers={"Allow": "POST"}
        )
    request[appkeys.FLOW] = Flow(request[appkeys.REQUEST_ID], resource=resource)
    headers.check_resource(resource)
    body = await params.json_body(request, {"at_least": int}, ("at_least",))
    at_least = _at_least(body["at_least"])
    highest = await request.app[appkeys.STORE].raise_fence(resource, at_least)
    logs.event(
        "fence_raised",
        resource=resource,
        at_least=at_least,
        highest_fence=highest,
        client=_client(request),
    )
    return web.json_response({"resource": resource, "highest_fence": highest})


def _at_least(value: int) -> int:
    if not 1 <= value <= grammar.MAX_FENCE:
        raise errors.InvalidRequest(
            f"at_least {value!r}: a whole number from 1 to {grammar.MAX_FENCE}"
        )
    return value


def _client(request: web.Request) -> str | None:
    client = request.get(appkeys.CLIENT)
    return client.name if client is not None else None
