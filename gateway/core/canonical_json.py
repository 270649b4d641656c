"""Canonical JSON (RFC 8785, the JSON Canonicalization Scheme), for the idempotency key and
fingerprint of an MCP tool call (docs/contract.md §16): two calls whose arguments differ only
in key order or whitespace are one operation.

Members are sorted by their names' UTF-16 code units, strings are written with the fewest
escapes, numbers as ECMAScript writes an IEEE 754 double. One deliberate difference: an
integer beyond ±(2**53 - 1), which a double cannot hold exactly, is written with all its
digits instead of being rounded, so two different integers never make one key.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

_SAFE_INTEGER = 2**53 - 1
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}


class NotCanonicalizable(ValueError):
    """A value canonical JSON cannot write: NaN, an infinity, or no JSON value at all."""


def canonical_json(value: Any) -> bytes:
    """`value` (as `json.loads` returns it) in canonical JSON, UTF-8 encoded."""
    parts: list[str] = []
    _write(value, parts)
    return "".join(parts).encode("utf-8", "surrogatepass")


def _write(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(_string(value))
    elif isinstance(value, int):
        out.append(str(value) if abs(value) > _SAFE_INTEGER else _number(float(value)))
    elif isinstance(value, float):
        out.append(_number(value))
    elif isinstance(value, list):
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _write(item, out)
        out.append("]")
    elif isinstance(value, dict):
        out.append("{")
        for index, name in enumerate(sorted(value, key=_utf16_units)):
            if index:
                out.append(",")
            out.append(_string(name))
            out.append(":")
            _write(value[name], out)
        out.append("}")
    else:
        raise NotCanonicalizable(f"{type(value).__name__} is not a JSON value")


def _utf16_units(name: str) -> bytes:
    """Big-endian UTF-16 bytes compare as the code units RFC 8785 sorts by."""
    return name.encode("utf-16-be", "surrogatepass")


def _string(value: str) -> str:
    chars = []
    for char in value:
        escaped = _ESCAPES.get(char)
        if escaped is not None:
            chars.append(escaped)
        elif char < " ":
            chars.append(f"\\u{ord(char):04x}")
        else:
            chars.append(char)
    return '"' + "".join(chars) + '"'


def _number(value: float) -> str:
    """ECMAScript's Number.prototype.toString of a double (RFC 8785 section 3.2.2.3)."""
    if value != value or value in (float("inf"), float("-inf")):
        raise NotCanonicalizable("NaN and infinities have no JSON form")
    if value == 0:
        return "0"  # -0 too
    sign = "-" if value < 0 else ""
    # repr is the shortest string that reads back as the same double, as ECMAScript's is
    digits_tuple, exponent = Decimal(repr(abs(value))).normalize().as_tuple()[1:]
    digits = "".join(map(str, digits_tuple))
    k = len(digits)
    n = int(exponent) + k  # value = 0.digits × 10**n
    if k <= n <= 21:
        text = digits + "0" * (n - k)
    elif 0 < n <= 21:
        text = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * -n + digits
    else:
        mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
        text = f"{mantissa}e{'+' if n - 1 >= 0 else '-'}{abs(n - 1)}"
    return sign + text
