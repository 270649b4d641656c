"""The targets the gateway is measured by (docs/design/performance.md), judged from one run.

A target is judged as every ratio of the bench is: a value for each round, from measurements
of that round, and the median of those values against the threshold. So a ratio of two rows
is the median of their per-round ratios, never the ratio of their medians (the two differ on a
noisy machine: 0.45 against 0.50 for PostgreSQL's row in one run). What is not measured per
round (the memory row, RSS) is judged on its one figure, the highest where there are several.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# One connection: the peer's p50 plus two fsyncs (admission, outcome) plus this much.
ONE_CONNECTION_SLACK_MS = 0.3
MAX_RSS_MIB = 200.0
FLAT = 1.05  # "flat between halves": the second half's RSS at most 5% above the first's


@dataclass(frozen=True, slots=True)
class Rounds:
    """Calls/s, p50 and p99 (ms) of one row, a value for each round."""

    rates: Sequence[float]
    p50s: Sequence[float]
    p99s: Sequence[float]


@dataclass(frozen=True, slots=True)
class Run:
    """What the targets are judged on. `*_peer`: the peer measured right before that row, in
    the same round; `peer_one`: the round's own peer row at one connection."""

    fdatasync_ms: float  # the median of the probe before the rounds
    hot: Rounds  # fenced strict POST, 1 hot resource, 32 connections
    hot_peer: Rounds
    one: Rounds  # the same at one connection
    one_peer: Rounds
    get: Rounds  # unfenced GET, 32 connections
    get_peer: Rounds
    spread: Rounds  # 10,000 resources
    serial: Rounds  # `serial`, one resource
    peer_one: Rounds
    flood_admitted: Sequence[float]  # admitted calls/s under 2,000 connections / the hot row's
    flood_p99: Sequence[float]  # the probe's admitted p99 / the hot row's p99
    flood_rss_mib: float
    memory_calls: int  # the memory row's calls (1,000,000 in a full run)
    memory_halves_mib: tuple[float, float]  # RSS after each half of them
    memory_peak_mib: float
    postgres: Rounds | None  # one replica, 64 resources; None when no server answered


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    values: tuple[float, ...]  # a value per round (or the one figure)
    threshold: float
    at_most: bool = False  # met at or below the threshold; else at or above
    unit: str = "×"

    @property
    def median(self) -> float:
        """NaN when nothing was measured (a probe that saw no admitted call)."""
        return statistics.median(self.values) if self.values else math.nan

    @property
    def met(self) -> bool:
        if self.at_most:
            return self.median <= self.threshold  # False for NaN, as every comparison is
        return self.median >= self.threshold

    def shown(self, value: float) -> str:
        if math.isnan(value):
            return "not measured"
        return f"{value:.0f} {self.unit}" if self.unit == "MiB" else f"{value:.2f}{self.unit}"


def ratios(a: Sequence[float], b: Sequence[float]) -> tuple[float, ...]:
    """`a` over `b`, round by round (the bench's every ratio)."""
    return tuple(x / y for x, y in zip(a, b, strict=True))


def differences(a: Sequence[float], b: Sequence[float]) -> tuple[float, ...]:
    """`a` less `b`, round by round."""
    return tuple(x - y for x, y in zip(a, b, strict=True))


def one_connection_allowance_ms(fdatasync_ms: float) -> float:
    """What the one-connection target lets a call add over the peer's p50: its two commits,
    counted as one fdatasync each, and ONE_CONNECTION_SLACK_MS."""
    return 2 * fdatasync_ms + ONE_CONNECTION_SLACK_MS


def judge(run: Run) -> list[Target]:
    """Every target, in the order docs/design/performance.md lists them."""
    fsyncs_ms = 2 * run.fdatasync_ms
    serial_bound = tuple(1000 / (fsyncs_ms + p50) for p50 in run.peer_one.p50s)  # calls/s
    memory_first, memory_second = run.memory_halves_mib
    targets = [
        Target("fenced strict POST, 1 hot resource, 32 connections: the peer's calls/s",
               ratios(run.hot.rates, run.hot_peer.rates), 1.0),
        Target("the same: its p99 against the peer's",
               ratios(run.hot.p99s, run.hot_peer.p99s), 1.5, at_most=True),
        Target(f"one connection: p50 over the peer's, at most 2 × fdatasync "
               f"({run.fdatasync_ms:.2f} ms) + {ONE_CONNECTION_SLACK_MS} ms",
               differences(run.one.p50s, run.one_peer.p50s),
               one_connection_allowance_ms(run.fdatasync_ms), at_most=True, unit=" ms"),
        Target("unfenced GET: the peer's calls/s", ratios(run.get.rates, run.get_peer.rates),
               1.3),
        Target("10,000 resources: one resource's calls/s",
               ratios(run.spread.rates, run.hot.rates), 0.95),
        Target("`serial`, one resource: its bound, 1 / (2 × fdatasync + the peer's "
               "one-connection p50)",
               ratios(run.serial.rates, serial_bound), 0.8),
        Target("2,000 connections: admitted calls/s, the 32-connection row's",
               tuple(run.flood_admitted), 0.9),
        Target("2,000 connections: admitted calls' p99, the 32-connection row's",
               tuple(run.flood_p99), 3.0, at_most=True),
        Target("2,000 connections: RSS", (run.flood_rss_mib,), MAX_RSS_MIB, at_most=True,
               unit="MiB"),
    ]  # fmt: skip
    if run.postgres is not None:
        targets.append(
            Target("PostgreSQL, one replica, 64 resources: the SQLite row's calls/s",
                   ratios(run.postgres.rates, run.hot.rates), 0.5),
        )  # fmt: skip
    calls = f"{run.memory_calls:,} calls"
    return [
        *targets,
        Target(f"{calls}: peak RSS", (run.memory_peak_mib,), MAX_RSS_MIB, at_most=True,
               unit="MiB"),
        Target(f"{calls}: RSS after the second half, the first's",
               (memory_second / memory_first,), FLAT, at_most=True),
    ]  # fmt: skip


def table(targets: list[Target]) -> str:
    """The targets as a Markdown table: the median, the rounds, met or not."""
    lines = ["| target | threshold | measured | by round | |", "|---|---|---|---|---|"]
    for t in targets:
        bound = f"{'≤' if t.at_most else '≥'} {t.shown(t.threshold)}"
        rounds = ", ".join(t.shown(v) for v in t.values) if len(t.values) > 1 else ""
        lines.append(
            f"| {t.name} | {bound} | {t.shown(t.median)} | {rounds} | "
            f"{'met' if t.met else 'not met'} |"
        )
    met = sum(t.met for t in targets)
    lines += ["", f"{met} of {len(targets)} met."]
    return "\n".join(lines)
