"""The fence floor decisions (docs/contract.md §18), as plain functions, and the OpenAPI
pattern of a raise's glob held against the gateway's own check."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.api import fences as fences_api
from gateway.api.openapi import GLOB_PATTERN, allowed_methods
from gateway.core import fences, floors
from gateway.core.fences import LeaseView
from gateway.core.floors import FenceRow, Floors, Raise
from gateway.core.globs import valid_glob
from gateway.core.grammar import MAX_FENCE

RESTORED = Floors(floor=1_000_005, epoch=1)
LEASE = LeaseView(owner="a", fence=5, client=None, live=True)


def gateway_check(fence: int, known: Floors, row: FenceRow, lease: LeaseView | None = LEASE):
    refusal, _owner = fences.check(
        "gateway",
        fence,
        row.issued,
        floors.accepted(known, "g/1", row),
        lease,
        None,
        None,
        False,
        floors.bound(known, "g/1", "gateway", row),
    )
    return refusal


def external_check(fence: int, known: Floors, row: FenceRow, resource: str = "ext/1"):
    refusal, _owner = fences.check(
        "external",
        fence,
        row.issued,
        floors.accepted(known, resource, row),
        None,
        None,
        None,
        False,
        floors.bound(known, resource, "external", row),
    )
    return refusal


class TestGatewayIssued:
    def test_without_floors_nothing_changes(self) -> None:
        row = FenceRow(issued=5, accepted=5)
        assert gateway_check(5, Floors(), row) is None
        assert gateway_check(4, Floors(), row) == "stale_fence"
        assert gateway_check(6, Floors(), row) == "fence_not_issued"

    def test_below_the_floor_is_stale_before_it_could_be_a_forgery(self) -> None:
        row = FenceRow(issued=5, accepted=5)
        assert gateway_check(5, RESTORED, row) == "stale_fence"
        assert gateway_check(500, RESTORED, row) == "stale_fence"  # never issued, still stale
        assert gateway_check(1_000_005, RESTORED, row) == "fence_not_issued"

    def test_the_next_acquire_is_at_least_the_floor(self) -> None:
        assert floors.next_fence(RESTORED, "g/1", FenceRow(issued=5, accepted=5)) == 1_000_005
        above = FenceRow(issued=2_000_000, accepted=2_000_000)
        assert floors.next_fence(RESTORED, "g/1", above) == 2_000_001

    def test_without_floors_a_new_fence_is_above_every_issued_and_accepted_one(self) -> None:
        assert floors.next_fence(Floors(), "g/1", FenceRow(issued=0, accepted=0)) == 1
        assert floors.next_fence(Floors(), "g/1", FenceRow(issued=3, accepted=9)) == 10
        assert floors.next_fence(Floors(), "g/1", FenceRow(issued=9, accepted=3)) == 10

    def test_a_raise_fences_out_the_current_lease_and_the_next_acquire_issues_above(
        self,
    ) -> None:
        raised = Floors(raises=(Raise("g/*", 50, 0),))
        row = FenceRow(issued=5, accepted=5)
        assert gateway_check(5, raised, row) == "stale_fence"
        assert floors.next_fence(raised, "g/1", row) == 51
        assert floors.next_fence(raised, "h/1", row) == 6  # the glob does not cover it


class TestExternal:
    def test_on_hold_after_a_restore_whatever_the_token(self) -> None:
        assert external_check(MAX_FENCE, RESTORED, FenceRow(accepted=40)) == "stale_fence"
        assert external_check(1, RESTORED, FenceRow()) == "stale_fence"

    def test_the_store_wide_floor_is_not_the_external_issuers(self) -> None:
        lifted = FenceRow(accepted=40, lifted=1)
        assert external_check(40, RESTORED, lifted) is None
        assert external_check(39, RESTORED, lifted) == "stale_fence"

    def test_a_glob_raise_of_this_epoch_lifts_the_hold_and_raises(self) -> None:
        known = Floors(floor=10, epoch=2, raises=(Raise("ext/**", 70, 2), Raise("**", 90, 1)))
        # the older epoch's raise still raises (fences never go back), but lifts nothing
        assert external_check(90, known, FenceRow(accepted=40)) is None
        assert external_check(89, known, FenceRow(accepted=40)) == "stale_fence"
        assert external_check(MAX_FENCE, known, FenceRow(), resource="other/1") == "stale_fence"

    def test_never_restored_never_on_hold(self) -> None:
        assert not floors.on_hold(Floors(), "ext/1", "external", 0)
        assert not floors.on_hold(RESTORED, "g/1", "gateway", 0)


def test_the_floor_stays_within_the_fence_range() -> None:
    assert floors.restore_floor(10, 1000) == 1010
    assert floors.restore_floor(MAX_FENCE - 5, 1000) == MAX_FENCE


def test_literal_prefix_narrows_every_match() -> None:
    assert floors.literal_prefix("team/a/**") == "team/a/"
    assert floors.literal_prefix("**") == ""
    assert floors.covered("team/*", ["team/a", "team/a/b", "teams/a"]) == ["team/a"]


_GLOB_ALPHABET = "ab.Z9_-:@/*"


def accepted_glob(value: str) -> bool:
    return len(value) <= fences_api.MAX_GLOB and valid_glob(value)


@given(st.text(alphabet=_GLOB_ALPHABET, min_size=0, max_size=12))
def test_glob_pattern_is_what_a_raise_accepts(value: str) -> None:
    assert (re.fullmatch(GLOB_PATTERN, value) is not None) == accepted_glob(value)


@pytest.mark.parametrize("value", ["**", "*", ".*", "..*", "a/**/b", ".", "..", "a//b", "*/"])
def test_glob_pattern_on_the_edge_cases(value: str) -> None:
    assert (re.fullmatch(GLOB_PATTERN, value) is not None) == accepted_glob(value)


def test_fences_raise_is_described_before_the_resource_it_could_also_be() -> None:
    # (PUT still raises a resource named "raise": the routes match by method first)
    assert allowed_methods("/_gateway/v1/fences/raise") == ["POST"]
    assert allowed_methods("/_gateway/v1/fences/team/a") == ["PUT"]
