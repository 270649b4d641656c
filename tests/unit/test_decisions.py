"""The pure decisions every store backend asks (docs/contract.md §3, §4, §6, §7, §9)."""

import pytest

from gateway.core import cleanups, fences, idempotency, leases, outcomes, receipts
from gateway.core.fences import LeaseView
from gateway.core.idempotency import KeyState, NewAttempt, Refuse, Replay
from gateway.core.outcomes import Completion

RETRY = frozenset({408, 425, 429, 503})


def key(
    status: str,
    *,
    http: int | None = None,
    replayable: bool = False,
    resolution: str | None = None,
    fp: str = "sha256:a",
    attempt: int = 1,
) -> KeyState:
    return KeyState("R1", fp, status, http, replayable, resolution, attempt)


class TestIdempotencyTable:
    """Each row of the key-state table (docs/contract.md §4)."""

    @pytest.mark.parametrize(
        ("latest", "expected"),
        [
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
        ],
    )
    def test_row(self, latest: KeyState | None, expected: object) -> None:
        assert idempotency.decide(latest, "sha256:a", RETRY) == expected

    def test_a_rejected_receipt_never_holds_a_key(self) -> None:
        with pytest.raises(ValueError, match="rejected"):
            idempotency.decide(key("rejected"), "sha256:a", RETRY)


class TestGatewayFence:
    """Step 4 for leases the gateway issued, in the contract's order."""

    lease = LeaseView(owner="run-b", fence=5, client="c1", live=True)

    @pytest.mark.parametrize(
        ("fence", "issued", "lease", "owner", "client", "clients", "code"),
        [
            (6, 5, lease, None, None, False, "fence_not_issued"),
            (4, 5, lease, None, None, False, "stale_fence"),
            (5, 5, lease, None, "c2", True, "not_lease_holder"),
            (5, 5, lease, "run-a", "c1", True, "owner_mismatch"),
            (5, 5, LeaseView("run-b", 5, None, live=False), None, None, False, "lease_expired"),
            (5, 5, None, None, None, False, "lease_expired"),
            (4, 5, None, None, None, False, "stale_fence"),
            (5, 5, lease, "run-b", "c1", True, None),
            (5, 5, lease, None, "other", False, None),
        ],
    )
    def test_check(self, fence, issued, lease, owner, client, clients, code) -> None:
        assert fences.check_gateway(fence, issued, lease, owner, client, clients) == code

    def test_external_accepts_equal_and_higher(self) -> None:
        assert fences.check_external(7, 7) is None
        assert fences.check_external(8, 7) is None
        assert fences.check_external(6, 7) == "stale_fence"


class TestKeys:
    def test_derived_key_matches_the_spec_formula(self) -> None:
        import hashlib

        expected = "gw-" + hashlib.sha256(b"r/1\nPOST\n/t/x?q=1\nbody").hexdigest()[:32]
        assert idempotency.derived_key("r/1", "POST", "/t/x?q=1", b"body") == expected

    def test_fingerprint_ignores_the_resource(self) -> None:
        import hashlib

        expected = "sha256:" + hashlib.sha256(b"POST\n/t/x\n\x00\xff").hexdigest()
        assert idempotency.fingerprint("POST", "/t/x", b"\x00\xff") == expected

    def test_random_keys_differ(self) -> None:
        assert idempotency.random_key() != idempotency.random_key()
        assert idempotency.random_key().startswith("gw-")

    def test_a_pruned_key_counts_its_earlier_attempts(self) -> None:
        assert idempotency.decide(None, "sha256:a", RETRY, pruned_attempts=2) == NewAttempt(3)


class TestFenceFacts:
    def test_the_owner_recorded_is_the_leases_when_the_token_is_its_fence(self) -> None:
        lease = LeaseView("run-b", 5, None, live=True)
        assert fences.recorded_owner("claimed", 5, lease) == "run-b"
        assert fences.recorded_owner("claimed", 4, lease) == "claimed"
        assert fences.recorded_owner(None, 5, None) is None


def lease(
    state: leases.LeaseState = "held",
    *,
    expires_at: float = 100.0,
    owner: str = "w",
    client: str | None = "c",
    key: str | None = "k",
    fence: int = 3,
) -> leases.Lease:
    return leases.Lease(
        resource="r",
        owner=owner,
        fence=fence,
        state=state,
        client=client,
        acquire_key=key,
        acquired_at=40.0,
        renewed_at=40.0,
        expires_at=expires_at,
    )


class TestAcquire:
    """The acquire compare-and-swap (docs/contract.md §6)."""

    @pytest.mark.parametrize(
        ("current", "now", "lock_delay", "expected"),
        [
            (None, 50.0, 0.0, leases.Grant()),
            (lease(), 50.0, 0.0, leases.Held()),
            (lease(), 100.0, 5.0, leases.Held()),  # expired, lock delay not over
            (lease(), 105.0, 5.0, leases.Grant(held_seconds=60.0)),  # taken over, not yet marked
            (lease("expired"), 105.0, 5.0, leases.Grant()),
            (lease("released"), 50.0, 5.0, leases.Grant()),
        ],
    )
    def test_cas(self, current, now, lock_delay, expected) -> None:
        assert leases.decide_acquire(current, "other", "c2", None, lock_delay, now) == expected

    def test_a_retry_by_the_same_client_and_key_gets_the_live_lease_back(self) -> None:
        assert leases.decide_acquire(lease(), "w", "c", "k", 0, 50.0) == leases.Retried()
        assert leases.decide_acquire(lease(), "w", "c", "k2", 0, 50.0) == leases.Held()
        assert leases.decide_acquire(lease(), "w", "c2", "k", 0, 50.0) == leases.Held()
        # an expired lease is never handed back: that would be a dead fence
        assert leases.decide_acquire(lease(), "w", "c", "k", 0, 150.0) == leases.Grant(60.0)

    def test_the_same_owner_name_alone_is_held(self) -> None:
        assert leases.decide_acquire(lease(), "w", "c", None, 0, 50.0) == leases.Held()


class TestRenewAndRelease:
    def test_only_the_live_holder_renews(self) -> None:
        assert leases.may_renew(lease(), "w", 3, "c", 50.0)
        assert not leases.may_renew(lease(), "w", 3, "c", 100.0)
        assert not leases.may_renew(lease(), "w", 2, "c", 50.0)
        assert not leases.may_renew(lease(), "w", 3, "other", 50.0)
        assert not leases.may_renew(lease("released"), "w", 3, "c", 50.0)
        assert not leases.may_renew(None, "w", 3, "c", 50.0)

    @pytest.mark.parametrize(
        ("current", "owner", "fence", "now", "expected"),
        [
            (lease(), "w", 3, 50.0, leases.Release(True, "release", 10.0)),
            (lease(), "x", 3, 50.0, leases.Release(False)),
            (lease(), "w", 2, 50.0, leases.Release(False)),
            (lease(), "w", 3, 120.0, leases.Release(True)),  # expired untaken
            (lease("released"), "w", 3, 50.0, leases.Release(True)),  # already released
            (None, "w", 3, 50.0, leases.Release(False)),
            (None, None, None, 50.0, leases.Release(True)),  # revoke of nothing
            (lease(), None, None, 120.0, leases.Release(True, "release", 60.0)),
            (lease("expired"), None, None, 120.0, leases.Release(True, "free")),
        ],
    )
    def test_release(self, current, owner, fence, now, expected) -> None:
        assert leases.decide_release(current, owner, fence, "c", now) == expected

    def test_a_held_lease_past_expiry_is_shown_expired(self) -> None:
        assert lease().shown(99.9) == "held"
        assert lease().shown(100.0) == "expired"
        assert lease("released").shown(200.0) == "released"


class TestCompletion:
    """What an outcome does to its receipt (docs/contract.md §3, "Outcome")."""

    @pytest.mark.parametrize(
        ("current", "outcome", "expected"),
        [
            ("pending", "succeeded", Completion.RECORDED),
            ("pending", "outcome_unknown", Completion.RECORDED),
            ("outcome_unknown", "failed", Completion.LATE),
            ("outcome_unknown", "outcome_unknown", Completion.UNCHANGED),
            ("outcome_unknown", "not_sent", Completion.UNCHANGED),
            ("reconciled", "succeeded", Completion.LATE_OUTCOME),
            ("reconciled", "outcome_unknown", Completion.UNCHANGED),
            ("succeeded", "failed", Completion.UNCHANGED),
            (None, "succeeded", Completion.MISSING),
        ],
    )
    def test_decide(self, current, outcome, expected) -> None:
        assert outcomes.decide_completion(current, outcome) == expected

    def test_only_a_recorded_known_outcome_settles_the_key(self) -> None:
        assert outcomes.settles_key(Completion.RECORDED, "succeeded")
        assert outcomes.settles_key(Completion.LATE, "failed")
        assert not outcomes.settles_key(Completion.RECORDED, "outcome_unknown")
        assert not outcomes.settles_key(Completion.LATE_OUTCOME, "succeeded")

    def test_answers(self) -> None:
        assert [outcomes.outcome_of_answer(s) for s in (200, 299, 199, 300, 404, 503)] == [
            "succeeded",
            "succeeded",
            "failed",
            "failed",
            "failed",
            "failed",
        ]


class TestReconciliation:
    waits = receipts.ReconcileWaits({"tool": 40.0}, default=70.0)

    def test_the_grace_counts_from_forwarded_at_else_created_at(self) -> None:
        assert self.waits.ready_at("tool", 10.0, 5.0) == 50.0
        assert self.waits.ready_at("tool", None, 5.0) == 45.0
        assert self.waits.ready_at("gone", 10.0, 5.0) == 80.0

    def test_only_unknown_receipts_past_their_grace_resolve(self) -> None:
        assert receipts.may_resolve("outcome_unknown", 50.0, 50.0)
        assert not receipts.may_resolve("outcome_unknown", 50.0, 49.9)
        assert not receipts.may_resolve("pending", 50.0, 99.0)

    @pytest.mark.parametrize(
        ("here", "heartbeat", "ready_at", "lost"),
        [
            (False, None, 1e9, True),  # no instance record: an earlier run's
            (False, 80.0, 1e9, True),  # silent for more than 10 s
            (False, 95.0, 99.0, True),  # older than timeout + grace
            (False, 95.0, 1e9, False),
            (True, None, 0.0, False),  # in flight here: never lost
        ],
    )
    def test_lost(self, here, heartbeat, ready_at, lost) -> None:
        assert (
            receipts.is_lost(
                in_flight_here=here,
                heartbeat_at=heartbeat,
                silent_after_s=10.0,
                ready_at=ready_at,
                now=100.0,
            )
            == lost
        )


class TestCleanupClaim:
    """The next step of an owed on_expiry cleanup (docs/contract.md §9)."""

    owed = cleanups.OwedCleanup(
        "r", lease_fence=3, lease_owner="w", due_at=10.0, attempts=1, sweep_fence=4
    )

    def attempt(self, status, resolution=None) -> KeyState:
        return KeyState("R4", "sha256:x", status, None, False, resolution, 1)

    def test_not_due(self) -> None:
        assert cleanups.decide_claim(self.owed, None, 4, "s", 9.0).state == "not_due"

    @pytest.mark.parametrize(
        ("status", "resolution", "state"),
        [
            ("pending", None, "waiting"),
            ("outcome_unknown", None, "waiting"),
            ("succeeded", None, "done"),
            ("reconciled", "applied", "done"),
            ("reconciled", "compensated", "done"),
        ],
    )
    def test_an_earlier_attempt_decides(self, status, resolution, state) -> None:
        claim = cleanups.decide_claim(self.owed, self.attempt(status, resolution), 4, "s", 20.0)
        assert (claim.state, claim.receipt_id) == (state, "R4")

    @pytest.mark.parametrize(
        ("status", "resolution"),
        [("failed", None), ("not_sent", None), ("reconciled", "not_applied")],
    )
    def test_a_failed_attempt_is_tried_again(self, status, resolution) -> None:
        assert (
            cleanups.decide_claim(self.owed, self.attempt(status, resolution), 4, "s", 20.0) is None
        )

    def test_a_new_owner_supersedes_it(self) -> None:
        claim = cleanups.decide_claim(self.owed, None, 5, "new-owner", 20.0)
        assert (claim.state, claim.holder) == ("superseded", "new-owner")

    def test_a_first_attempt_follows_the_expired_lease(self) -> None:
        first = cleanups.OwedCleanup("r", 3, "w", due_at=10.0, attempts=0, sweep_fence=None)
        assert cleanups.decide_claim(first, None, 3, "w", 20.0) is None
        assert cleanups.decide_claim(first, None, 4, "x", 20.0).state == "superseded"


class TestOneEntryPoints:
    """The single calls both store backends make for the fence check and cleanup claims."""

    def test_check_by_issuer(self) -> None:
        view = LeaseView("run-b", 5, None, live=True)
        assert fences.check("external", 4, 0, 7, view, "x", None, False) == ("stale_fence", "x")
        assert fences.check("external", 7, 0, 7, None, "x", None, False) == (None, "x")
        assert fences.check("gateway", 5, 5, 0, view, None, None, False) == (None, "run-b")
        assert fences.check("gateway", 6, 5, 0, view, "x", None, False) == (
            "fence_not_issued",
            "x",
        )

    def test_a_lease_is_viewed_live_until_it_expires(self) -> None:
        assert lease().view(99.0) == LeaseView("w", 3, "c", live=True)
        assert lease().view(100.0).live is False
        assert lease("released").view(50.0).live is False

    def test_a_claim_counts_its_attempt_and_keys_its_fence(self) -> None:
        owed = cleanups.OwedCleanup("r", 3, "w", due_at=0.0, attempts=2, sweep_fence=4)
        assert cleanups.claimed(owed, 6) == cleanups.CleanupClaim(
            "claimed", fence=6, key="gw-sweep-6", attempt=3, lease_fence=3, lease_owner="w"
        )

    @pytest.mark.parametrize(
        ("state", "action"),
        [
            ("waiting", "recheck"),
            ("busy", "recheck"),
            ("done", "forget"),
            ("superseded", "forget"),
            ("claimed", "keep"),
            ("not_due", "keep"),
        ],
    )
    def test_what_the_owed_row_needs_after_a_claim(self, state, action) -> None:
        assert cleanups.row_action(cleanups.CleanupClaim(state)) == action
