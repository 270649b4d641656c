"""The short soak: real gateway processes under a nemesis (kill -9 and restart, SIGSTOP past
a lease's TTL, and on PostgreSQL cut database connections), concurrent clients with rising
and stale tokens, a tool that records every side effect; the history checker must find
nothing. `make soak DURATION=300` runs the long form (tests/soak/__main__.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.soak.run import SoakConfig, soak

# About 30 s for both stores together, start and teardown included; a soak runs at least
# one round of the nemesis (every fault once), however short.
DURATION_S = {"sqlite": 6.0, "postgresql": 5.0}


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
async def test_a_short_soak_has_a_clean_history(store: str, tmp_path: Path) -> None:
    report = await soak(
        SoakConfig(
            store=store,
            duration_s=DURATION_S[store],
            workdir=tmp_path,
            clients=10,
            nemesis_gap_s=(0.2, 1.0),
        )
    )
    text = report.text()
    assert report.violations == [], text
    counts = report.counts
    # The run did what it is for: every fault happened, calls reached the tool and were
    # acknowledged, and stale tokens were sent and refused.
    faults = ["kills", "pauses"] + (["connection kills"] if store == "postgresql" else [])
    assert all(counts[fault] >= 1 for fault in faults), text
    assert counts["side effects"] > 0 and counts["calls acknowledged"] > 0, text
    assert counts.get("calls refused 409 stale_fence", 0) > 0, text
    assert counts["leases acquired"] > 0, text
