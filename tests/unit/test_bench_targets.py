"""How `make bench` judges the targets (tests/bench/targets.py): round by round, then the
median, against each threshold."""

from __future__ import annotations

from dataclasses import replace

from tests.bench.targets import Rounds, Run, judge, table


def rounds(*rates: float, p50: float = 1.0, p99: float = 10.0) -> Rounds:
    return Rounds(rates, [p50] * len(rates), [p99] * len(rates))


def run_meeting_every_target() -> Run:
    """Three rounds in which every target is met."""
    return Run(
        fdatasync_ms=0.1,
        hot=rounds(4000, 4100, 4200, p99=12),
        hot_peer=rounds(3900, 4000, 4100, p99=10),
        one=rounds(900, 900, 900, p50=0.9),
        one_peer=rounds(2000, 2000, 2000, p50=0.45),
        get=rounds(6000, 6000, 6000),
        get_peer=rounds(4000, 4000, 4000),
        spread=rounds(3900, 4000, 4100),
        serial=rounds(1300, 1300, 1300),
        peer_one=rounds(2000, 2000, 2000, p50=0.45),
        flood_admitted=[0.95, 1.0, 1.05],
        flood_p99=[2.0, 2.5, 2.9],
        flood_rss_mib=120,
        memory_calls=1_000_000,
        memory_halves_mib=(130, 131),
        memory_peak_mib=132,
        postgres=rounds(2100, 2100, 2100),
    )


def by_name(run: Run) -> dict[str, bool]:
    return {target.name: target.met for target in judge(run)}


def test_a_run_meeting_every_target_is_judged_so() -> None:
    judged = judge(run_meeting_every_target())
    assert len(judged) == 12
    assert all(target.met for target in judged), [t.name for t in judged if not t.met]
    assert table(judged).endswith("12 of 12 met.")


def test_a_ratio_of_two_rows_is_the_median_of_its_rounds_not_the_ratio_of_their_medians() -> None:
    # PostgreSQL 1,031, 1,149, 514 against SQLite 2,296, 1,940, 2,042 calls/s (one run): the
    # medians' ratio is 0.505, the rounds' ratios 0.45, 0.59, 0.25
    run = replace(
        run_meeting_every_target(),
        hot=rounds(2296, 1940, 2042, p99=12),
        hot_peer=rounds(2000, 1900, 2000, p99=10),
        spread=rounds(2296, 1940, 2042),
        postgres=rounds(1031, 1149, 514),
    )
    [postgres] = [t for t in judge(run) if t.name.startswith("PostgreSQL")]
    assert [round(v, 2) for v in postgres.values] == [0.45, 0.59, 0.25]
    assert round(postgres.median, 2) == 0.45
    assert not postgres.met


def test_each_target_fails_alone_when_its_own_figure_misses() -> None:
    good = run_meeting_every_target()
    misses = {
        "fenced strict POST": replace(good, hot=rounds(3000, 3000, 3000, p99=12)),
        "the same: its p99": replace(good, hot=rounds(4000, 4100, 4200, p99=16)),
        # 0.45 + 0.5 allowed: 0.2 of two fdatasyncs and 0.3
        "one connection": replace(good, one=rounds(800, 800, 800, p50=0.96)),
        "unfenced GET": replace(good, get=rounds(5000, 5000, 5000)),
        "10,000 resources": replace(good, spread=rounds(3700, 3800, 3900)),
        # the bound: 1 / (0.2 + 0.45 ms) = 1,538 calls/s; 0.8 of it 1,231
        "`serial`": replace(good, serial=rounds(1000, 1100, 1200)),
        "2,000 connections: admitted calls/s": replace(good, flood_admitted=[0.8, 0.85, 0.95]),
        "2,000 connections: admitted calls' p99": replace(good, flood_p99=[2.0, 3.1, 4.0]),
        "2,000 connections: RSS": replace(good, flood_rss_mib=210),
        "1,000,000 calls: peak RSS": replace(good, memory_peak_mib=201),
        "1,000,000 calls: RSS after": replace(good, memory_halves_mib=(120, 130)),
        "PostgreSQL": replace(good, postgres=rounds(1900, 1900, 1900)),
    }
    for prefix, run in misses.items():
        failed = [name for name, met in by_name(run).items() if not met]
        assert len(failed) == 1 and failed[0].startswith(prefix), (prefix, failed)


def test_a_probe_that_saw_no_admitted_call_is_not_measured_and_not_met() -> None:
    judged = judge(replace(run_meeting_every_target(), flood_p99=[]))
    [p99] = [t for t in judged if t.name.startswith("2,000 connections: admitted calls' p99")]
    assert not p99.met
    assert "not measured" in table(judged)


def test_without_postgresql_its_target_is_left_out() -> None:
    judged = judge(replace(run_meeting_every_target(), postgres=None))
    assert not any(t.name.startswith("PostgreSQL") for t in judged)
    assert table(judged).endswith("11 of 11 met.")
