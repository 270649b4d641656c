"""The decisions of docs/contract.md §17 as plain functions: what a checkpoint may hold, what
an identical retry is, where a receipt goes in the run view, and the run view's `state`."""

from __future__ import annotations

import json
import re

import pytest

from gateway.api import checkpoints as api
from gateway.core import checkpoints
from gateway.core.checkpoints import (
    Append,
    BadCheckpoint,
    Checkpoint,
    NewCheckpoint,
    Refuse,
    Retry,
    decide_write,
    encoded_state,
    group_of,
    run_state,
)
from gateway.core.fences import LeaseView
from gateway.core.floors import FenceRow, Floors
from gateway.core.receipts import RECEIPT_STATUSES, ReconcileWaits

WAITS = ReconcileWaits({"tool": 10.0}, default=30.0)


def new(fence: int = 3, step: str = "s", state: object = 1, owner: str | None = None):
    return NewCheckpoint("r/1", fence, owner, None, step, encoded_state(state), 60)


def stored(seq: int, fence: int = 3, step: str = "s", state: object = 1, owner="run-a"):
    return Checkpoint("r/1", seq, fence, owner, None, step, encoded_state(state), 100.0)


LIVE = LeaseView(owner="run-a", fence=3, client=None, live=True)


class TestTheState:
    def test_measured_as_compact_utf8_json(self) -> None:
        assert encoded_state({"a": [1, 2], "é": None}) == '{"a":[1,2],"é":null}'
        limit = checkpoints.MAX_STATE_BYTES
        encoded_state("x" * (limit - 2))  # the quotes make it exactly the limit
        with pytest.raises(BadCheckpoint):
            encoded_state("x" * (limit - 1))
        with pytest.raises(BadCheckpoint):
            encoded_state("é" * (limit // 2))  # two bytes each

    @pytest.mark.parametrize(
        "value", [float("nan"), float("inf"), "\ud800", {"k": [float("-inf")]}]
    )
    def test_what_is_not_json_is_refused(self, value: object) -> None:
        with pytest.raises(BadCheckpoint):
            encoded_state(value)

    @pytest.mark.parametrize(
        ("step", "ok"),
        [("a", True), ("x" * 128, True), ("x" * 129, False), ("", False), ("a\tb", False),
         ("deploy → prod", True), ("a\x85", False), ("\ud800", False)],
    )  # fmt: skip
    def test_step(self, step: str, ok: bool) -> None:
        if ok:
            assert checkpoints.checked_step(step) == step
        else:
            with pytest.raises(BadCheckpoint):
                checkpoints.checked_step(step)
        # the OpenAPI document states the same rule (surrogates aside: no JSON Schema
        # string holds one)
        if "\ud800" not in step:
            assert (re.fullmatch(checkpoints.STEP_PATTERN, step) is not None) == ok


class TestWriteDecision:
    def test_the_owner_appends_after_the_latest(self) -> None:
        assert decide_write(
            "gateway", new(), FenceRow(3, 3), Floors(), LIVE, None, False
        ) == Append(1, "run-a")
        latest = stored(4)
        assert decide_write(
            "gateway", new(state=2), FenceRow(3, 3), Floors(), LIVE, latest, False
        ) == Append(5, "run-a")

    def test_an_identical_retry_of_the_latest_appends_nothing(self) -> None:
        latest = stored(4, state={"a": 1, "b": 2})
        retry = new(state={"b": 2, "a": 1})
        assert decide_write(
            "gateway", retry, FenceRow(3, 3), Floors(), LIVE, latest, False
        ) == Retry(latest)
        # X-Lease-Owner sent or not, the recorded owner is the lease's
        named = new(state={"a": 1, "b": 2}, owner="run-a")
        assert decide_write(
            "gateway", named, FenceRow(3, 3), Floors(), LIVE, latest, False
        ) == Retry(latest)

    @pytest.mark.parametrize(
        "change",
        [{"step": "t"}, {"state": {"a": 1, "b": 3}}, {"state": {"a": 1, "b": True}}],
    )
    def test_anything_else_is_a_new_checkpoint(self, change: dict[str, object]) -> None:
        latest = stored(4, state={"a": 1, "b": 1})
        fields = {"step": "s", "state": {"a": 1, "b": 1}, **change}
        candidate = new(step=str(fields["step"]), state=fields["state"])
        assert decide_write(
            "gateway", candidate, FenceRow(3, 3), Floors(), LIVE, latest, False
        ) == Append(5, "run-a")

    def test_an_external_fence_keeps_the_owner_as_presented(self) -> None:
        latest = stored(1, fence=3, owner=None)
        assert decide_write(
            "external", new(owner="w"), FenceRow(0, 3), Floors(), None, latest, False
        ) == Append(2, "w")
        assert decide_write(
            "external", new(), FenceRow(0, 3), Floors(), None, latest, False
        ) == Retry(latest)
        assert decide_write(
            "external", new(fence=2), FenceRow(0, 3), Floors(), None, latest, False
        ) == Refuse("stale_fence")

    @pytest.mark.parametrize(
        ("fence", "lease", "owner", "code"),
        [
            (4, LIVE, None, "fence_not_issued"),
            (2, LIVE, None, "stale_fence"),
            (3, LeaseView("run-a", 3, None, live=False), None, "lease_expired"),
            (3, LIVE, "run-b", "owner_mismatch"),
        ],
    )
    def test_the_fence_check_of_a_call(self, fence, lease, owner, code) -> None:
        candidate = new(fence=fence, owner=owner)
        assert decide_write(
            "gateway", candidate, FenceRow(3, 3), Floors(), lease, None, False
        ) == Refuse(code)


class TestRunView:
    def test_every_status_has_its_list(self) -> None:
        groups = {status: group_of(status) for status in RECEIPT_STATUSES}
        assert groups == {
            "pending": "needs_confirmation",
            "outcome_unknown": "needs_confirmation",
            "succeeded": "completed",
            "failed": "completed",
            "not_sent": "completed",
            "reconciled": "completed",
            "rejected": "rejected",
        }

    @pytest.mark.parametrize(
        ("unknown", "exists", "live", "now", "state"),
        [
            ({"tool": 100.0}, True, True, 110.0, "reconciliation_required"),
            ({"tool": 100.0}, True, True, 109.9, "outcome_unknown"),
            ({"gone": 100.0}, False, False, 129.9, "outcome_unknown"),  # default wait
            ({"gone": 100.0, "tool": 50.0}, False, False, 61.0, "reconciliation_required"),
            ({}, True, True, 0.0, "lease_valid"),
            ({}, True, False, 0.0, "lease_lost"),
            ({}, False, False, 0.0, "idle"),
        ],
    )
    def test_state(self, unknown, exists, live, now, state) -> None:
        assert run_state(unknown, exists, live, WAITS, now) == state

    def test_an_agent_is_not_shown_the_highest_fence(self) -> None:
        from gateway.store.base import RunRecords

        records = RunRecords(None, 9, stored(1), [], [], 0, {}, 200.0)
        shown = api.view_json("r/1", records, WAITS, agent=True)
        assert "highest_fence" not in shown and shown["state"] == "idle"
        assert json.loads(json.dumps(shown))["checkpoint"]["state"] == 1
        assert api.view_json("r/1", records, WAITS, agent=False)["highest_fence"] == 9


@pytest.mark.parametrize("cursor", ["before:0", "before:1", "before:9223372036854775807"])
def test_checkpoint_cursors_the_pattern_admits(cursor: str) -> None:
    assert re.fullmatch(api.CURSOR_PATTERN, cursor)
    assert api._before({"cursor": cursor}) == int(cursor.removeprefix("before:"))


def test_a_cursor_beyond_every_seq_is_a_harmless_bound() -> None:
    assert api._before({"cursor": "before:9999999999999999999"}) == 2**63 - 1
