"""Chart geometry, as plain functions of plain values: the templates only draw what these
return (inline SVG, made on the server; the browser runs no script for it).

Coordinates are SVG user units, y growing downwards. Every function is total: no data, one
value, a zero span and huge fences all give a drawable chart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    value: int
    label: str


@dataclass(frozen=True, slots=True)
class BarChart:
    width: int
    height: int
    bars: tuple[Bar, ...]
    peak: int


def bar_chart(
    values: Sequence[int], labels: Sequence[str], width: int, height: int, gap: float = 2.0
) -> BarChart:
    """One bar per value, side by side, scaled so the tallest fills the height."""
    if len(values) != len(labels):
        raise ValueError("one label per value")
    peak = max(values, default=0)
    slot = width / len(values) if values else float(width)
    bars = tuple(
        Bar(
            x=round(index * slot + gap / 2, 2),
            y=round(height - _share(value, peak) * height, 2),
            width=round(max(slot - gap, 1.0), 2),
            height=round(_share(value, peak) * height, 2),
            value=value,
            label=label,
        )
        for index, (value, label) in enumerate(zip(values, labels, strict=True))
    )
    return BarChart(width, height, bars, peak)


def _share(value: int, peak: int) -> float:
    return value / peak if peak > 0 else 0.0


@dataclass(frozen=True, slots=True)
class FencePoint:
    """One call on the resource: when it came, with which fence, and whether it was let in."""

    at: float
    fence: int
    admitted: bool
    label: str


@dataclass(frozen=True, slots=True)
class Mark:
    x: float
    y: float
    point: FencePoint


@dataclass(frozen=True, slots=True)
class Tick:
    at: float  # x for the time axis, y for the fence axis
    label: str


@dataclass(frozen=True, slots=True)
class FenceChart:
    width: int
    height: int
    left: float
    top: float
    right: float
    bottom: float
    line: str  # SVG polyline points: the highest admitted fence, as a step over time
    admitted: tuple[Mark, ...]
    refused: tuple[Mark, ...]
    fence_ticks: tuple[Tick, ...]
    time_ticks: tuple[Tick, ...]


_MARGIN_LEFT, _MARGIN_RIGHT, _MARGIN_TOP, _MARGIN_BOTTOM = 52.0, 8.0, 10.0, 24.0


def fence_chart(
    points: Sequence[FencePoint], start: float, end: float, width: int = 480, height: int = 200
) -> FenceChart:
    """The fence over time between `start` and `end`: a step line of the highest fence let
    in so far, a dot per admitted call and a cross per refused one, each at its fence."""
    left, top = _MARGIN_LEFT, _MARGIN_TOP
    right, bottom = width - _MARGIN_RIGHT, height - _MARGIN_BOTTOM
    span = max(end - start, 1e-9)
    fences = [p.fence for p in points]
    low, high = (min(fences), max(fences)) if fences else (1, 1)
    if low == high:  # one level: give it room above and below
        low, high = max(low - 1, 0), high + 1

    def x_of(at: float) -> float:
        return round(left + min(max((at - start) / span, 0.0), 1.0) * (right - left), 2)

    def y_of(fence: float) -> float:
        return round(bottom - (fence - low) / (high - low) * (bottom - top), 2)

    ordered = sorted(points, key=lambda p: p.at)
    steps: list[tuple[float, float]] = []
    highest: int | None = None
    for point in ordered:
        if not point.admitted or (highest is not None and point.fence <= highest):
            continue
        x = x_of(point.at)
        if highest is not None:
            steps.append((x, y_of(highest)))
        highest = point.fence
        steps.append((x, y_of(highest)))
    if highest is not None:
        steps.append((right, y_of(highest)))
    return FenceChart(
        width=width,
        height=height,
        left=left,
        top=top,
        right=right,
        bottom=bottom,
        line=" ".join(f"{x},{y}" for x, y in steps),
        admitted=tuple(Mark(x_of(p.at), y_of(p.fence), p) for p in ordered if p.admitted),
        refused=tuple(Mark(x_of(p.at), y_of(p.fence), p) for p in ordered if not p.admitted),
        fence_ticks=tuple(Tick(y_of(value), str(value)) for value in integer_ticks(low, high)),
        time_ticks=tuple(
            Tick(x_of(at), time_label(at, span)) for at in (start, start + span / 2, end)
        ),
    )


def integer_ticks(low: int, high: int, most: int = 5) -> list[int]:
    """Whole numbers from `low` to `high` at the finest round step (1, 2 or 5 times a power
    of ten) that gives at most `most` of them."""
    if high < low:
        low, high = high, low
    exponent = 0
    while True:
        for factor in (1, 2, 5):
            step = factor * 10**exponent
            first = -(-low // step) * step  # the first multiple of step at or above low
            if (high - first) // step + 1 <= most:
                return list(range(first, high + 1, step))
        exponent += 1


def fitted_span(
    times: Sequence[float], start: float, end: float, least_s: float = 60.0
) -> tuple[float, float]:
    """The part of [start, end] worth drawing: from a little before the first of `times` to
    `end`, at least `least_s` long (so a burst of calls is not one vertical line at the edge
    of a day), never before `start`."""
    if not times:
        return start, end
    first = min(times)
    begin = first - (end - first) * 0.05
    return max(start, min(begin, end - least_s)), end


def time_label(at: float, span: float) -> str:
    """A time on an axis, in UTC: to the second for spans under an hour, with the day for
    spans over one."""
    fmt = "%H:%M:%S" if span < 3600 else "%m-%d %H:%M" if span > 86_400 else "%H:%M"
    return time.strftime(fmt, time.gmtime(at))
