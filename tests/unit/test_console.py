"""The console's plain decisions: chart geometry, counting, durations, who may do what,
sessions and where a form may send the browser back (docs/console.md)."""

from __future__ import annotations

import pytest

from gateway.console import charts, paths, tallies
from gateway.console.access import LOCAL_OPERATOR, NOBODY, Permissions, client_viewer, permissions
from gateway.console.charts import FencePoint
from gateway.console.sessions import (
    MOST_SIGNING_IN,
    SIGN_IN_TTL_S,
    SIGNED_IN_TTL_S,
    Flash,
    SessionBook,
    csrf_matches,
)
from gateway.core import errors
from gateway.store.base import Receipt
from tests.harness import FakeClock

# -- charts -------------------------------------------------------------------------------------


def test_bars_are_scaled_to_the_tallest_and_sit_on_the_baseline() -> None:
    chart = charts.bar_chart([0, 2, 4], ["a", "b", "c"], width=30, height=10, gap=2)
    assert [(b.x, b.y, b.width, b.height) for b in chart.bars] == [
        (1.0, 10.0, 8.0, 0.0),
        (11.0, 5.0, 8.0, 5.0),
        (21.0, 0.0, 8.0, 10.0),
    ]
    assert chart.peak == 4


def test_bars_of_nothing_are_flat_and_of_no_values_are_none() -> None:
    assert {b.height for b in charts.bar_chart([0, 0], ["a", "b"], 10, 10).bars} == {0.0}
    assert charts.bar_chart([], [], 10, 10).bars == ()
    with pytest.raises(ValueError):
        charts.bar_chart([1], [], 10, 10)


def point(at: float, fence: int, admitted: bool = True) -> FencePoint:
    return FencePoint(at=at, fence=fence, admitted=admitted, label=f"{fence}@{at}")


def test_the_fence_line_steps_up_at_each_higher_admitted_fence_and_runs_to_the_end() -> None:
    chart = charts.fence_chart(
        [point(10, 1), point(20, 1), point(30, 2), point(40, 1, admitted=False), point(60, 3)],
        start=0,
        end=100,
        width=152,  # a plot 92 wide, inside margins of 52 (left) and 8 (right)
        height=134,  # a plot 100 high, inside margins of 10 (top) and 24 (bottom)
    )
    assert (chart.left, chart.right, chart.top, chart.bottom) == (52, 144, 10, 110)
    # x = 52 + at/100 * 92; fences 1..3 over 100 px: 1 at 110, 2 at 60, 3 at 10
    assert chart.line == "61.2,110.0 79.6,110.0 79.6,60.0 107.2,60.0 107.2,10.0 144.0,10.0"
    assert [(m.point.fence, m.y) for m in chart.admitted] == [(1, 110), (1, 110), (2, 60), (3, 10)]
    assert [(m.point.fence, m.x) for m in chart.refused] == [(1, 88.8)]
    assert [t.label for t in chart.fence_ticks] == ["1", "2", "3"]


def test_a_chart_without_calls_or_with_one_level_is_still_drawable() -> None:
    empty = charts.fence_chart([], start=0, end=60)
    assert empty.line == "" and empty.admitted == () and [t.label for t in empty.fence_ticks]
    flat = charts.fence_chart([point(5, 7)], start=5, end=5)  # a zero span
    assert flat.admitted[0].x == flat.left and flat.top < flat.admitted[0].y < flat.bottom
    huge = charts.fence_chart([point(1, 2**63 - 2), point(2, 2**63 - 1)], start=0, end=3)
    assert len(huge.fence_ticks) <= 5


@pytest.mark.parametrize(
    ("low", "high", "ticks"),
    [
        (1, 3, [1, 2, 3]),
        (0, 10, [0, 5, 10]),
        (7, 7, [7]),
        (1, 1000, [200, 400, 600, 800, 1000]),
        (5, 2, [2, 3, 4, 5]),
    ],
)
def test_integer_ticks_are_round_and_few(low: int, high: int, ticks: list[int]) -> None:
    assert charts.integer_ticks(low, high) == ticks


def test_the_time_axis_fits_the_calls_not_the_whole_window() -> None:
    assert charts.fitted_span([], 0, 86_400) == (0, 86_400)
    start, end = charts.fitted_span([86_390, 86_395], 0, 86_400)
    assert end == 86_400 and start == 86_400 - 60  # a burst: at least a minute is drawn
    start, _ = charts.fitted_span([40_000], 0, 86_400)
    assert start == pytest.approx(40_000 - 0.05 * 46_400)
    assert charts.fitted_span([10], 0, 30) == (0, 30)  # never before the window


# -- counting ---------------------------------------------------------------------------------


def test_bucket_counts_slice_the_span_and_drop_what_is_outside() -> None:
    times = [0, 4.9, 5, 9.99, 10, -1, 12]
    assert tallies.bucket_counts(times, 0, 10, 2) == [2, 2]
    assert tallies.bucket_counts(times, 0, 0, 2) == [0, 0]


def receipt(status: str, code: str | None = None) -> Receipt:
    return Receipt(
        id="r", resource="a", fence=1, owner=None, client=None, upstream="u", method="POST",
        path="/", idempotency_key=None, fingerprint=None, attempt=1, status=status,  # type: ignore[arg-type]
        http_status=None, error=None, reject_code=code, late=False, created_at=0.0,
        forwarded_at=None, completed_at=None, instance="i", resolution=None,
    )  # fmt: skip


def test_refusals_are_counted_by_code_most_first_and_statuses_in_life_order() -> None:
    receipts = [
        receipt("rejected", "stale_fence"),
        receipt("rejected", "lease_expired"),
        receipt("rejected", "stale_fence"),
        receipt("succeeded"),
        receipt("outcome_unknown"),
    ]
    assert tallies.refusals_by_code(receipts) == [("stale_fence", 2), ("lease_expired", 1)]
    assert tallies.status_counts(receipts) == [
        ("succeeded", 1),
        ("outcome_unknown", 1),
        ("rejected", 3),
    ]


@pytest.mark.parametrize(
    ("seconds", "words"),
    [(0, "0s"), (45.9, "45s"), (192, "3m 12s"), (7500, "2h 5m"), (3 * 86_400 + 4 * 3600, "3d 4h")],
)
def test_durations_in_two_units_at_most(seconds: float, words: str) -> None:
    assert tallies.duration(seconds) == words


def test_a_lease_time_left_in_words() -> None:
    assert tallies.time_left("held", 130, 100) == "30s left"
    assert tallies.time_left("held", 100, 130) == "expired 30s ago"  # not yet marked expired
    assert tallies.time_left("expired", 100, 160) == "expired 1m ago"
    assert tallies.time_left("released", 100, 50) == "released"


def test_clock_shows_milliseconds_today_and_the_date_otherwise() -> None:
    noon = 1_764_504_000.25  # 2025-11-30T12:00:00.250Z
    assert tallies.clock(noon, noon + 60) == "12:00:00.250"
    assert tallies.clock(noon, noon + 86_400) == "2025-11-30 12:00:00"
    assert tallies.clock(None, noon) == "–"


def test_a_window_is_one_of_the_named_ones() -> None:
    assert tallies.window(None) == ("24h", 86_400.0)
    assert tallies.window("1h") == ("1h", 3600.0)
    with pytest.raises(errors.InvalidRequest):
        tallies.window("1y")


# -- who may do what (docs/contract.md §10) -------------------------------------------------------


@pytest.mark.parametrize(
    ("roles", "may"),
    [
        ({"agent"}, Permissions()),
        ({"reconciler"}, Permissions(read=True, resolve=True)),
        ({"agent", "reconciler"}, Permissions(read=True, resolve=True)),
        ({"admin"}, Permissions(read=True, resolve=True, revoke=True)),
    ],
)
def test_roles_give_the_console_permissions(roles: set[str], may: Permissions) -> None:
    assert permissions(roles) == may
    assert client_viewer("c", roles).may == may


def test_nobody_may_do_anything_and_the_open_gateway_operator_everything() -> None:
    assert NOBODY.may == Permissions()
    assert LOCAL_OPERATOR.may == Permissions(read=True, resolve=True, revoke=True)
    assert client_viewer("alice", ["reconciler"]).source == "operator:alice"


# -- sessions -----------------------------------------------------------------------------------


def test_a_session_is_found_by_its_token_until_it_expires() -> None:
    clock = FakeClock(1000.0)
    book = SessionBook(clock)
    token, session = book.start(client_viewer("alice", ["reconciler"]))
    assert book.find(token) is session and book.find("other") is None and book.find(None) is None
    clock.advance(SIGNED_IN_TTL_S - 1)
    assert book.find(token) is session
    clock.advance(1)
    assert book.find(token) is None and len(book) == 0


def test_a_sign_in_session_is_short_and_ending_one_forgets_it() -> None:
    clock = FakeClock(0.0)
    book = SessionBook(clock)
    token, session = book.start(NOBODY)
    assert session.expires_at == SIGN_IN_TTL_S
    book.end(token)
    assert book.find(token) is None


def test_visitors_who_never_sign_in_cannot_push_out_a_signed_in_session() -> None:
    clock = FakeClock(0.0)
    book = SessionBook(clock)
    token, _ = book.start(client_viewer("alice", ["reconciler"]))
    first, _ = book.start(NOBODY)
    for _ in range(MOST_SIGNING_IN + 5):
        clock.advance(0.001)
        book.start(NOBODY)
    assert book.find(token) is not None  # still signed in
    assert book.find(first) is None  # the oldest sign-in form's session made room
    assert len(book) == 1 + MOST_SIGNING_IN


def test_the_csrf_token_must_be_the_sessions_own() -> None:
    _, session = SessionBook().start(NOBODY)
    assert csrf_matches(session, session.csrf)
    assert not csrf_matches(session, session.csrf + "x")
    assert not csrf_matches(session, None)
    assert not csrf_matches(None, session.csrf)
    assert not csrf_matches(session, "ü\udcff")  # any text compares, none raises


def test_flashes_are_shown_once() -> None:
    _, session = SessionBook().start(NOBODY)
    done = Flash("done", "receipt resolved")
    session.flashes.append(done)
    assert session.take_flashes() == [done] and session.take_flashes() == []


# -- where a form may send the browser ------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "goes_to"),
    [
        ("/_gateway/console/queue", "/_gateway/console/queue"),
        ("/_gateway/console/leases?state=held&after=a/b", "/_gateway/console/leases?state=held&after=a/b"),  # noqa: E501
        ("/_gateway/console/resources/a/b?window=1h", "/_gateway/console/resources/a/b?window=1h"),
        (None, "/default"),
        ("https://evil.example/", "/default"),
        ("//evil.example/_gateway/console", "/default"),
        ("/_gateway/console//evil.example", "/default"),
        ("/_gateway/console\\evil", "/default"),
        ("/_gateway/consoleX", "/default"),
        ("/_gateway/v1/leases", "/default"),
        ("/_gateway/console/queue\nLocation: x", "/default"),
    ],
)  # fmt: skip
def test_a_form_sends_the_browser_back_only_inside_the_console(
    value: str | None, goes_to: str
) -> None:
    assert paths.back_to(value, "/default") == goes_to


def test_resource_pages_keep_the_slashes_of_the_resource() -> None:
    assert paths.resource_page("chat/room-1") == "/_gateway/console/resources/chat/room-1"
