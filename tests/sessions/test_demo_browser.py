"""`fence-gateway demo --browser` (docs/contract.md §15): the race over a real Chromium, played
end to end with its evidence; without a browser it says so and exits 2."""

from __future__ import annotations

import pytest

from gateway.cli import demo_browser
from gateway.cli.main import build_parser
from tests.sessions.chromium import chromium_path


async def test_the_browser_race_is_won_by_the_new_owner() -> None:
    lines: list[str] = []
    assert await demo_browser.run_demo(lines.append, chromium_path()) == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert "The shop page received 2 click(s): A 1, B 2" in text
    # cut by B's admission (4409), or by the lease watch if it looked first (4408)
    assert (
        "its session was closed by the gateway (4409 stale_fence)" in text
        or "its session was closed by the gateway (4408 lease_expired)" in text
    ), text


async def test_without_a_browser_it_says_so_and_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_browser, "find_chromium", lambda: None)
    lines: list[str] = []
    assert await demo_browser.run_demo(lines.append) == 2
    assert "needs Chromium" in lines[0]


def test_the_flag() -> None:
    assert build_parser().parse_args(["demo", "--browser"]).browser
    assert not build_parser().parse_args(["demo"]).browser
