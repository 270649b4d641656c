"""What a call's span says (docs/contract.md §21), as pure decisions: its name from the
mount, the fencing decision, and only the attributes that are known."""

from __future__ import annotations

import pytest

from gateway.core.spans import call_attributes, decision_of, span_name


def test_the_name_is_the_method_and_the_mount_never_the_path() -> None:
    assert span_name("POST", "/tool") == "POST /tool"
    assert span_name("GET", None) == "GET"


@pytest.mark.parametrize(
    ("error_code", "admitted", "replayed", "decision"),
    [
        (None, True, False, "admitted"),
        ("upstream_timeout", True, False, "admitted"),  # admitted, whatever became of it
        ("resource_busy", True, False, "admitted"),
        (None, False, True, "replayed"),
        ("stale_fence", False, False, "rejected"),
        ("tool_not_allowed", False, False, "rejected"),
        ("store_unavailable", False, False, "rejected"),
        ("overloaded", False, False, "shed"),
        (None, False, False, "unfenced"),
        ("upstream_unreachable", False, False, "unfenced"),  # an unfenced call's own failure
    ],
)
def test_the_decision(
    error_code: str | None, admitted: bool, replayed: bool, decision: str
) -> None:
    assert decision_of(error_code, admitted, replayed) == decision


def test_attributes_are_those_known() -> None:
    assert call_attributes(
        decision="admitted",
        resource="orders/a",
        fence=5,
        receipt_id="01ABC",
        outcome="outcome_unknown",
        error_code="upstream_timeout",
    ) == {
        "fence_gateway.decision": "admitted",
        "fence_gateway.resource": "orders/a",
        "fence_gateway.fence": 5,
        "fence_gateway.receipt_id": "01ABC",
        "fence_gateway.outcome": "outcome_unknown",
        "error.type": "upstream_timeout",
    }
    unfenced = dict(decision="unfenced", resource=None, fence=None, receipt_id=None, outcome=None)
    assert call_attributes(**unfenced, error_code=None) == {"fence_gateway.decision": "unfenced"}


def test_a_refusal_that_left_a_receipt_has_the_outcome_rejected() -> None:
    refused = dict(decision="rejected", resource="orders/a", fence=4, outcome=None)
    assert (
        call_attributes(**refused, receipt_id="01R", error_code="stale_fence")[
            "fence_gateway.outcome"
        ]
        == "rejected"
    )
    assert "fence_gateway.outcome" not in call_attributes(
        **refused, receipt_id=None, error_code="missing_fence"
    )
