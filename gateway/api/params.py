"""Query-string and JSON-body parsing for /_gateway/v1: anything off is `400 invalid_request`."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterable
from decimal import Decimal
from typing import Any

from aiohttp import web

from gateway.core import errors
from gateway.core.grammar import MAX_FENCE
from gateway.core.times import parse_rfc3339
from gateway.proxy import appkeys

MAX_LIMIT = 1000
_WHOLE_DIGITS = 30  # a whole number beyond 10**30 is out of every range: left a float


def only(request: web.Request, allowed: Iterable[str]) -> dict[str, str]:
    """The query as a dict; an unknown or repeated parameter is refused."""
    allowed = set(allowed)
    params: dict[str, str] = {}
    for name, value in request.query.items():
        if name not in allowed:
            raise errors.InvalidRequest(f"unknown parameter {name!r}; known: {sorted(allowed)}")
        if name in params:
            raise errors.InvalidRequest(f"parameter {name!r} was given twice")
        if "\x00" in value:  # no key, name or id holds one; PostgreSQL text cannot
            raise errors.InvalidRequest(f"parameter {name!r} holds a NUL character")
        params[name] = value
    return params


def limit(params: dict[str, str]) -> int:
    value = params.get("limit", "100")
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= MAX_LIMIT:
        raise errors.InvalidRequest(f"limit {value!r}: a whole number from 1 to {MAX_LIMIT}")
    return int(value)


def integer(params: dict[str, str], name: str) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if not value.isascii() or not value.isdigit() or int(value) > MAX_FENCE:
        raise errors.InvalidRequest(f"{name} {value!r}: a whole number from 0 to {MAX_FENCE}")
    return int(value)


def moment(params: dict[str, str], name: str) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    try:
        return parse_rfc3339(value)
    except ValueError:
        raise errors.InvalidRequest(
            f"{name} {value!r}: an RFC 3339 time with a zone, e.g. 2026-08-29T05:07:00.000Z"
        ) from None


# A cursor is the position of the last item of a page (a receipt id, a resource key) behind a
# tag. Clients treat it as opaque (docs/contract.md §7); it is kept this plain so that the set of
# cursors the gateway accepts is one regular expression, the one its OpenAPI document states:
# every string matching it is a harmless lower bound, and anything else is `400`.
CURSOR_TAG = "after:"
CURSOR_PATTERN = r"^after:[A-Za-z0-9._\-:@/]{1,256}$"
_CURSOR = re.compile(CURSOR_PATTERN)


def encode_cursor(position: str) -> str:
    return CURSOR_TAG + position


def decode_cursor(params: dict[str, str]) -> str | None:
    value = params.get("cursor")
    if value is None:
        return None
    if not _CURSOR.fullmatch(value):
        raise errors.InvalidRequest(f"cursor {value!r} is not one this gateway gave out")
    return value.removeprefix(CURSOR_TAG)


def page(items: list[dict[str, Any]], size: int, end: str | None) -> dict[str, Any]:
    """A list's answer; `end`: the position of its last item. `next_cursor` is set exactly
    when the page is full."""
    cursor = encode_cursor(end) if len(items) == size and end is not None else None
    return {"items": items, "next_cursor": cursor}


def _json_number(literal: str) -> int | float:
    """A JSON number with a fraction or exponent: an int when it is a whole number, as JSON
    Schema counts `16270.0` an integer; read exactly, so a large fence is never rounded."""
    exact = Decimal(literal)
    if exact == exact.to_integral_value() and exact.adjusted() <= _WHOLE_DIGITS:
        return int(exact)
    return float(literal)


async def json_body(
    request: web.Request, fields: dict[str, type | tuple[type, ...]], required: Iterable[str]
) -> dict[str, Any]:
    """A JSON object with only `fields` (name -> accepted types), `required` present."""
    timeout_s = request.app[appkeys.SETTINGS].body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()  # at most the app's client_max_size (1 MiB): 413 above
    except TimeoutError:
        raise errors.RequestTimeout(f"the body did not arrive within {timeout_s}s") from None
    return json_object(raw, fields, required)


def json_object(
    raw: bytes,
    fields: dict[str, type | tuple[type, ...]],
    required: Iterable[str],
    parse_float: Callable[[str], Any] = _json_number,
) -> dict[str, Any]:
    """`raw` as a JSON object with only `fields` (name -> accepted types), `required`
    present; an empty body is an empty object. `parse_float`: how a number with a fraction
    or exponent is read (by default a whole one becomes an exact int)."""
    try:
        body = json.loads(raw, parse_float=parse_float) if raw else {}
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise errors.InvalidRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise errors.InvalidRequest("the body must be a JSON object")
    for name, value in body.items():
        if name not in fields:
            raise errors.InvalidRequest(f"unknown field {name!r}; known: {sorted(fields)}")
        accepted = fields[name]
        types = accepted if isinstance(accepted, tuple) else (accepted,)
        # a JSON true is no number, though Python's bool is an int
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise errors.InvalidRequest(f"{name}: {value!r} has the wrong type")
    for name in required:
        if name not in body:
            raise errors.InvalidRequest(f"{name!r} is required")
    return body
