"""Times as the contract writes them (RFC 3339 UTC with milliseconds), and the clock seam.

Every time the gateway stores is epoch seconds (a float); it becomes text only where it leaves
the process, in an API answer or a log line.
"""

from __future__ import annotations

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


def parse_rfc3339(text: str) -> float:
    """RFC 3339 → epoch seconds; ValueError for anything else (a naive time is refused)."""
    moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return moment.timestamp()
