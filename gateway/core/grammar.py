"""What well-formed values look like: resources, fences, owners, idempotency keys, request ids
(docs/contract.md §3, steps 2 and 3)."""

from __future__ import annotations

import re

MAX_FENCE = 2**63 - 1

# segments of resource characters separated by single `/`, none of them `.` or `..`
_SEGMENT = r"(?!\.\.?(?:/|\Z))[A-Za-z0-9._\-:@]+"
_RESOURCE = re.compile(rf"(?=.{{1,256}}\Z){_SEGMENT}(?:/{_SEGMENT})*", re.DOTALL)
_OWNER = re.compile(r"[A-Za-z0-9._\-:@/]{1,128}")
_FENCE = re.compile(r"[1-9][0-9]*")  # ASCII only: re with str patterns needs re.ASCII for \d
_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,200}")
# An HTTP header name (RFC 9110 §5.1), as a pattern: policies check names as text, the
# server checks them as bytes off the wire
HTTP_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"


def valid_resource(value: str) -> bool:
    """1 to 256 of `A-Z a-z 0-9 . _ - : @ /`, segments separated by single `/`, no empty,
    `.` or `..` segment."""
    return _RESOURCE.fullmatch(value) is not None


def fence_value(value: str) -> int | None:
    """The token as an int, or None when it is not `[1-9][0-9]*` within 1..2^63-1."""
    if not _FENCE.fullmatch(value) or len(value) > 19:
        return None
    fence = int(value)
    return fence if fence <= MAX_FENCE else None


def valid_owner(value: str) -> bool:
    """An owner name (X-Lease-Owner, a lease's owner): 1 to 128 resource characters."""
    return _OWNER.fullmatch(value) is not None


def valid_client_key(value: str) -> bool:
    """A client's Idempotency-Key: 1 to 255 visible ASCII characters, not starting with `gw-`
    (the gateway's own keys)."""
    return _IDEMPOTENCY_KEY.fullmatch(value) is not None and not value.startswith("gw-")


def valid_request_id(value: str) -> bool:
    return _REQUEST_ID.fullmatch(value) is not None
