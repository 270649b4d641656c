"""Times as the contract writes them (RFC 3339 UTC with milliseconds), and the clock seam.

Every time the gateway stores is epoch seconds (a float); it becomes text only where it leaves
the process, in an API answer or a log line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime

Clock = Callable[[], float]
"""Wall-clock epoch seconds (`time.time`); injected where time is the subject of a test."""


def rfc3339(ts: float | None) -> str | None:
    """Epoch seconds → `2026-08-29T05:07:00.000Z` (UTC, milliseconds)."""
    if ts is None:
        return None
    moment = datetime.fromtimestamp(ts, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


# RFC 3339's date-time (§5.6): fromisoformat also takes ISO 8601's other forms (basic format,
# week dates, a space or a comma, hours alone), which the contract's filters refuse.
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:[Zz]|[+-][0-9]{2}:[0-9]{2})"
)


def parse_rfc3339(text: str) -> float:
    """RFC 3339 → epoch seconds; ValueError for anything else (a naive time is refused)."""
    if _RFC3339.fullmatch(text) is None:
        raise ValueError(f"{text!r} is not an RFC 3339 date-time")
    moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return moment.timestamp()
