"""Counting receipts for the pages: calls over time, refusals by code, statuses, and durations
in words. Plain functions of plain values."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence

from gateway.core import errors
from gateway.core.floors import Floors
from gateway.core.globs import glob_matches
from gateway.core.receipts import RECEIPT_STATUSES
from gateway.store.base import Receipt

# How far back the resource page looks; the overview always looks one hour back.
WINDOWS = {"1h": 3600.0, "24h": 86_400.0, "7d": 604_800.0}
DEFAULT_WINDOW = "24h"
# A lost outcome, whether someone has decided it since (reconciled) or not yet.
LOST_STATUSES = frozenset({"outcome_unknown", "reconciled"})


def window(value: str | None) -> tuple[str, float]:
    name = DEFAULT_WINDOW if value is None else value
    if name not in WINDOWS:
        raise errors.InvalidRequest(f"window {value!r}: one of {', '.join(WINDOWS)}")
    return name, WINDOWS[name]


def bucket_counts(times: Iterable[float], start: float, end: float, buckets: int) -> list[int]:
    """How many of `times` fall in each of `buckets` equal slices of [start, end); times
    outside are not counted."""
    counts = [0] * buckets
    span = end - start
    if buckets <= 0 or span <= 0:
        return counts
    for at in times:
        if start <= at < end:
            counts[min(int((at - start) / span * buckets), buckets - 1)] += 1
    return counts


def refusals_by_code(receipts: Iterable[Receipt]) -> list[tuple[str, int]]:
    """Refused calls per error code, the most frequent first."""
    counts = Counter(r.reject_code or "unknown" for r in receipts if r.status == "rejected")
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


def status_counts(receipts: Iterable[Receipt]) -> list[tuple[str, int]]:
    """Receipts per status, in the order a receipt's life runs, statuses with none left out."""
    counts = Counter(r.status for r in receipts)
    return [(status, counts[status]) for status in RECEIPT_STATUSES if counts[status]]


def duration(seconds: float) -> str:
    """`45s`, `3m 12s`, `2h 5m`, `3d 4h`: two units at most, rounded down."""
    total = int(abs(seconds))
    days, rest = divmod(total, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts: Sequence[tuple[int, str]] = (
        (days, "d"),
        (hours, "h"),
        (minutes, "m"),
        (secs, "s"),
    )
    shown = [f"{value}{unit}" for value, unit in parts if value][:2]
    return " ".join(shown) or "0s"


def clock(at: float | None, now: float) -> str:
    """A time in a table, in UTC: to the millisecond on the day of `now`, else with its date."""
    if at is None:
        return "–"
    moment, today = time.gmtime(at), time.gmtime(now)
    if moment[:3] == today[:3]:
        return time.strftime("%H:%M:%S", moment) + f".{int(at * 1000) % 1000:03d}"
    return time.strftime("%Y-%m-%d %H:%M:%S", moment)


def time_left(state: str, expires_at: float, now: float) -> str:
    """A lease's time left in words (its state as shown: held, expired or released)."""
    if state == "released":
        return "released"
    if state == "held" and expires_at > now:
        return f"{duration(expires_at - now)} left"
    return f"expired {duration(now - expires_at)} ago"


def globs_on_hold(floors: Floors, external_globs: Iterable[str]) -> list[str]:
    """The external rules' globs still on hold after a restore or an asynchronous failover
    (docs/contract.md §18, §19): none raised since by a glob raise covering the whole glob
    (a raise of single resources lifts only those)."""
    if floors.epoch == 0:
        return []
    return [
        glob
        for glob in external_globs
        if not any(r.epoch >= floors.epoch and glob_matches(r.match, glob) for r in floors.raises)
    ]
