"""The adaptive limit behind `GATEWAY_MAX_INFLIGHT=auto` (gateway.core.concurrency)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.config.settings import Settings
from gateway.core.concurrency import GradientLimit, next_limit

KNOBS = {"tolerance": 1.5, "smoothing": 0.2, "min_limit": 20, "max_limit": 1000}


def test_steady_latency_while_busy_lets_the_limit_grow_by_its_square_root() -> None:
    assert next_limit(100, 0.010, 0.010, 100, **KNOBS) == 100 * 0.8 + (100 + 10) * 0.2


def test_a_window_far_below_the_limit_changes_nothing() -> None:
    assert next_limit(100, 0.500, 0.010, 49, **KNOBS) == 100


def test_latency_above_tolerance_shrinks_the_limit_at_most_by_half_per_window() -> None:
    twice = next_limit(100, 0.030, 0.010, 100, **KNOBS)  # 1.5 × 10 / 30: gradient 0.5
    assert twice == 100 * 0.8 + (100 * 0.5 + 10) * 0.2
    far = next_limit(100, 10.0, 0.010, 100, **KNOBS)
    assert far == twice  # the gradient never goes below 0.5


def test_the_limit_stays_within_its_bounds() -> None:
    assert next_limit(20, 1.0, 0.01, 20, **KNOBS) == 20
    assert next_limit(1000, 0.01, 0.01, 1000, **KNOBS) == 1000


def test_windows_need_both_time_and_calls() -> None:
    limit = GradientLimit(limit=40, min_limit=20, min_samples=10, window_s=0.1)
    for i in range(9):
        limit.sample(0.010, 40, now=i * 0.1)
    assert limit.long_rtt == 0  # nine calls over 0.8 s: no window closed yet
    limit.sample(0.010, 40, now=0.9)
    assert abs(limit.long_rtt - 0.010) < 1e-12
    assert limit.current == int(40 * 0.8 + (40 + 40**0.5) * 0.2)


def simulate(
    clients: int, seconds: float, limit: GradientLimit, start: float = 0.0
) -> tuple[int, float]:
    """A process that completes `capacity` calls/s with `base` latency when idle, driven by
    `clients` that each send their next call as soon as they have an answer (or a 503), from
    `start` for `seconds`. Returns the limit at the end and the latency of admitted calls."""
    capacity, base, step = 3000.0, 0.002, 0.001
    now, latency = start, base
    while now < start + seconds:
        admitted = min(clients, limit.current)
        latency = max(base, admitted / capacity)  # Little's law once the process is saturated
        for _ in range(max(1, int(admitted / latency * step))):
            limit.sample(latency, admitted, now)
        now += step
    return limit.current, latency


def test_a_fresh_process_takes_a_burst() -> None:
    assert GradientLimit().current == 1000


def test_an_ordinary_load_is_never_shed() -> None:
    final, _ = simulate(32, 20.0, GradientLimit())
    assert final >= 32


def test_a_flood_of_clients_is_held_to_a_bounded_latency() -> None:
    """After a calm minute at 32 clients, 2,000 arrive: the limit falls back to its floor, and
    the admitted calls' latency stays a small multiple of the calm one instead of growing with
    the crowd (2,000 calls in progress would take 0.67 s each)."""
    limit = GradientLimit(limit=300)
    _, calm = simulate(32, 60.0, limit)
    final, flooded = simulate(2000, 10.0, limit, start=60.0)
    assert final == limit.min_limit
    assert flooded < 3.5 * calm and flooded < 0.1 * (2000 / 3000)


def test_below_the_floor_a_lower_limit_would_find_a_lower_latency() -> None:
    """With a floor of 20 the same flood is held closer to the calm latency: the floor trades
    latency under a flood for never shedding an ordinary load (see `min_limit`)."""
    limit = GradientLimit(limit=300, min_limit=20)
    _, calm = simulate(32, 60.0, limit)
    final, flooded = simulate(2000, 10.0, limit, start=60.0)
    assert 20 <= final < 100
    assert flooded < 3 * calm


@pytest.mark.parametrize(("raw", "parsed"), [("auto", "auto"), ("AUTO", "auto"), ("64", 64)])
def test_the_setting_is_auto_or_a_number(raw: str, parsed: object) -> None:
    assert Settings(max_inflight=raw).max_inflight == parsed


@pytest.mark.parametrize("raw", ["0", "-3", "lots", "1.5"])
def test_other_settings_are_refused(raw: str) -> None:
    with pytest.raises(ValidationError, match="max_inflight"):
        Settings(max_inflight=raw)
