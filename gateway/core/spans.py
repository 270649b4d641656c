"""What the gateway's span of a proxied call says of it (docs/contract.md §21), decided from
plain values: the span's name, the fencing decision and the attributes.

The span carries the fencing facts and the gateway's own error code, never a key, an injected
credential or a body: the values here are the ones the receipt and the log line already show.
"""

from __future__ import annotations

from typing import Literal

Decision = Literal["admitted", "replayed", "rejected", "shed", "unfenced"]

# An unfenced call's own failures: its tool could not be reached or did not answer. Any other
# error of a call that was not admitted is the gateway refusing it.
_UNFENCED_FAILURES = frozenset(
    {"upstream_unreachable", "upstream_outcome_unknown", "upstream_timeout"}
)
_SHED = "overloaded"


def span_name(method: str, mount: str | None) -> str:
    """`{METHOD} {mount}`: the route, never the raw path (a resource id in a path would make
    one span name per resource); just the method when no mount matched."""
    return method if mount is None else f"{method} {mount}"


def decision_of(error_code: str | None, admitted: bool, replayed: bool) -> Decision:
    """What the gateway decided about the call: shed by the overload limit, answered from a
    stored answer, admitted (whatever became of it after), refused, or never fenced."""
    if error_code == _SHED:
        return "shed"
    if replayed:
        return "replayed"
    if admitted:
        return "admitted"
    if error_code is None or error_code in _UNFENCED_FAILURES:
        return "unfenced"
    return "rejected"


def call_attributes(
    *,
    decision: Decision,
    resource: str | None,
    fence: int | None,
    receipt_id: str | None,
    outcome: str | None,
    error_code: str | None,
) -> dict[str, str | int]:
    """The span's `fence_gateway.*` attributes and `error.type`, those that are known. The
    outcome is the receipt's status: an admitted call's, or `rejected` when a refusal left a
    receipt."""
    if outcome is None and decision == "rejected" and receipt_id is not None:
        outcome = "rejected"
    attributes: dict[str, str | int] = {"fence_gateway.decision": decision}
    for name, value in (
        ("fence_gateway.resource", resource),
        ("fence_gateway.fence", fence),
        ("fence_gateway.receipt_id", receipt_id),
        ("fence_gateway.outcome", outcome),
        ("error.type", error_code),
    ):
        if value is not None:
            attributes[name] = value
    return attributes
