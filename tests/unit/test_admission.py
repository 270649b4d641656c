"""The pure admission rules: fence checks and the SPEC 4 idempotency table."""

import pytest

from gateway.core import admission
from gateway.core.admission import KeyState, LeaseState, NewAttempt, Refuse, Replay

RETRY = frozenset({408, 425, 429, 503})


def key(status: str, *, http: int | None = None, replayable: bool = False,
        resolution: str | None = None, fp: str = "sha256:a", attempt: int = 1) -> KeyState:
    return KeyState("R1", fp, status, http, replayable, resolution, attempt)


class TestIdempotencyTable:
    """Each row of SPEC section 4's table."""

    @pytest.mark.parametrize(("latest", "expected"), [
        (None, NewAttempt(1)),
        (key("succeeded", http=200, fp="sha256:other"), Refuse("idempotency_key_reused", None)),
        (key("succeeded", http=200, replayable=True), Replay("R1")),
        (key("failed", http=400, replayable=True), Replay("R1")),
        (key("succeeded", http=200), Refuse("already_completed", "R1")),
        (key("failed", http=503, replayable=True, attempt=2), NewAttempt(3)),
        (key("pending"), Refuse("idempotency_in_flight", "R1")),
        (key("outcome_unknown"), Refuse("outcome_unknown", "R1")),
        (key("reconciled", resolution="applied"), Refuse("already_completed", "R1")),
        (key("reconciled", resolution="compensated"), Refuse("already_completed", "R1")),
        (key("reconciled", resolution="not_applied"), NewAttempt(2)),
        (key("not_sent"), NewAttempt(2)),
    ])
    def test_row(self, latest: KeyState | None, expected: object) -> None:
        assert admission.decide_idempotency(latest, "sha256:a", RETRY) == expected

    def test_a_rejected_receipt_never_holds_a_key(self) -> None:
        with pytest.raises(ValueError, match="rejected"):
            admission.decide_idempotency(key("rejected"), "sha256:a", RETRY)


class TestGatewayFence:
    """SPEC 3 step 4 for leases the gateway issued, in the SPEC's order."""

    lease = LeaseState(owner="run-b", fence=5, client="c1", held=True)

    @pytest.mark.parametrize(("fence", "issued", "lease", "owner", "client", "clients", "code"), [
        (6, 5, lease, None, None, False, "fence_not_issued"),
        (4, 5, lease, None, None, False, "stale_fence"),
        (5, 5, lease, None, "c2", True, "not_lease_holder"),
        (5, 5, lease, "run-a", "c1", True, "owner_mismatch"),
        (5, 5, LeaseState("run-b", 5, None, held=False), None, None, False, "lease_expired"),
        (5, 5, None, None, None, False, "lease_expired"),
        (4, 5, None, None, None, False, "stale_fence"),
        (5, 5, lease, "run-b", "c1", True, None),
        (5, 5, lease, None, "other", False, None),
    ])
    def test_check(self, fence, issued, lease, owner, client, clients, code) -> None:
        assert admission.check_gateway_fence(fence, issued, lease, owner, client,
                                             clients) == code

    def test_external_accepts_equal_and_higher(self) -> None:
        assert admission.check_external_fence(7, 7) is None
        assert admission.check_external_fence(8, 7) is None
        assert admission.check_external_fence(6, 7) == "stale_fence"


class TestKeys:
    def test_derived_key_matches_the_spec_formula(self) -> None:
        import hashlib

        expected = "gw-" + hashlib.sha256(b"r/1\nPOST\n/t/x?q=1\nbody").hexdigest()[:32]
        assert admission.derived_key("r/1", "POST", "/t/x?q=1", b"body") == expected

    def test_fingerprint_ignores_the_resource(self) -> None:
        import hashlib

        expected = "sha256:" + hashlib.sha256(b"POST\n/t/x\n\x00\xff").hexdigest()
        assert admission.fingerprint("POST", "/t/x", b"\x00\xff") == expected

    def test_random_keys_differ(self) -> None:
        assert admission.random_key() != admission.random_key()
        assert admission.random_key().startswith("gw-")
