"""The headers the gateway reads, sets and strips.

Each parser takes the request's multidict and returns a plain value or raises that header's
error (docs/contract.md §3); the grammar itself is `gateway.core.grammar`'s. A header sent
twice is that header's 400.
"""

from __future__ import annotations

import functools
import random

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.core import errors
from gateway.core.grammar import (
    MAX_FENCE,
    fence_value,
    valid_client_key,
    valid_owner,
    valid_request_id,
    valid_resource,
)

RESOURCE_HEADER = "X-Lease-Resource"
FENCE_HEADER = "X-Fence-Token"
SIGNATURE_HEADER = "X-Fence-Signature"
OWNER_HEADER = "X-Lease-Owner"
RECEIPT_HEADER = "X-Receipt-Id"
REQUEST_ID_HEADER = "X-Request-Id"
IDEMPOTENCY_HEADER = "Idempotency-Key"

# Hop-by-hop headers (RFC 9110 section 7.6.1) plus proxy credentials meant for the gateway.
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Proxy-Authorization",
        "Proxy-Authenticate",
    )
)

# Headers a client must never pass to the tool: the gateway sets the ones that matter itself.
GATEWAY_OWNED = frozenset(
    h.lower()
    for h in (
        FENCE_HEADER,
        SIGNATURE_HEADER,
        RESOURCE_HEADER,
        OWNER_HEADER,
        RECEIPT_HEADER,
        "Forwarded",
        "X-Forwarded-Host",
        "Host",
        "Content-Length",
    )
)


def single(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], name: str, error: type[errors.GatewayError]
) -> str | None:
    """The header's one value, None when absent; sent twice is `error`."""
    values = headers.getall(name, [])
    if len(values) > 1:
        raise error(f"{name} was sent {len(values)} times")
    return values[0] if values else None


def parse_resource(headers: CIMultiDictProxy[str]) -> str:
    value = single(headers, RESOURCE_HEADER, errors.InvalidResource)
    if value is None:
        raise errors.MissingResource(f"{RESOURCE_HEADER} is required on a fenced call")
    return check_resource(value)


def check_resource(value: str) -> str:
    """`value` when it is a resource key, else `400 invalid_resource`: the header's check, and
    the lease API's and the console's for a resource in their paths."""
    if not valid_resource(value):
        raise errors.InvalidResource(
            f"{value!r} is not a resource: 1 to 256 of A-Z a-z 0-9 . _ - : @ /, "
            "segments separated by single '/', no '.' or '..' segment"
        )
    return value


def parse_fence(headers: CIMultiDictProxy[str]) -> int:
    value = single(headers, FENCE_HEADER, errors.InvalidFence)
    if value is None:
        raise errors.MissingFence(f"{FENCE_HEADER} is required on a fenced call")
    fence = fence_value(value)
    if fence is None:
        raise errors.InvalidFence(
            f"{value!r} is not a fencing token: a decimal integer from 1 to {MAX_FENCE}"
        )
    return fence


def parse_owner(headers: CIMultiDictProxy[str]) -> str | None:
    value = single(headers, OWNER_HEADER, errors.InvalidRequest)
    if value is not None and not valid_owner(value):
        raise errors.InvalidRequest(f"{OWNER_HEADER} {value!r}: 1 to 128 resource characters")
    return value


def parse_idempotency_key(headers: CIMultiDictProxy[str]) -> str | None:
    value = single(headers, IDEMPOTENCY_HEADER, errors.InvalidIdempotencyKey)
    if value is None:
        return None
    if not valid_client_key(value):
        raise errors.InvalidIdempotencyKey(
            f"{IDEMPOTENCY_HEADER}: 1 to 255 visible ASCII characters, not starting with 'gw-'"
        )
    return value


def parse_signature(headers: CIMultiDictProxy[str]) -> str | None:
    return single(headers, SIGNATURE_HEADER, errors.BadFenceSignature)


def new_request_id() -> str:
    """Request ids must be unique, not secret: no system call for randomness per request."""
    return f"{random.getrandbits(128):032x}"


def request_id(headers: CIMultiDictProxy[str]) -> str | None:
    """The client's request id when it is usable, else None (the gateway makes one)."""
    values = headers.getall(REQUEST_ID_HEADER, [])
    if len(values) == 1 and valid_request_id(values[0]):
        return values[0]
    return None


def connection_named(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    """Header names listed in `Connection`: hop-by-hop for this one connection."""
    named: set[str] = set()
    for value in headers.getall("Connection", []):
        named.update(token.strip().lower() for token in value.split(",") if token.strip())
    return named


def strip(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], *drop: frozenset[str]
) -> list[tuple[str, str]]:
    """The headers without hop-by-hop ones, those named in `Connection`, and those of `drop`."""
    removed = _removed(drop)
    if "Connection" in headers:
        removed = removed | connection_named(headers)
    return [(k, v) for k, v in headers.items() if k.lower() not in removed]


@functools.cache
def _removed(drop: tuple[frozenset[str], ...]) -> frozenset[str]:
    """HOP_BY_HOP and the sets of `drop`: made once for each of the few combinations the
    callers use."""
    return HOP_BY_HOP.union(*drop)
