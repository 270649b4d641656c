"""The store contract for sessions (docs/contract.md §15), on every backend: a session's
admission takes no key, its receipt says `kind: session` and keeps its `session` object, the
watch reads fences and leases in one call, and the age rule of §9 leaves open sessions alone.
Then each backend's migration to the schema that has them."""

import dataclasses
import sqlite3
from pathlib import Path

import pytest

from gateway.core.sessions import FenceState, SessionRecord, ended_by_gateway
from gateway.core.times import rfc3339
from gateway.store.base import Admitted, Call, Outcome, Refused, Rejection, Replayed
from gateway.store.sqlite import SCHEMA_VERSION, SchemaTooNew, SqliteStore
from tests.store.test_contract import NO_WAIT, call, ok


def session(fence: int, resource: str = "acct/1", issuer: str = "external") -> Call:
    return dataclasses.replace(
        call(fence, resource=resource, issuer=issuer),
        method="GET",
        path="/devtools/browser/b1",
        idempotency_key=None,
        fingerprint=None,
        retry_statuses=frozenset(),
        kind="session",
    )


class TestSessionReceipts:
    async def test_admission_takes_no_key_and_advances_the_fence(self, store) -> None:
        opened = await store.admit(session(5))
        assert isinstance(opened, Admitted) and opened.attempt is None
        receipt = (await store.get_receipt(opened.receipt_id)).to_json()
        assert {k: receipt[k] for k in ("kind", "method", "status", "session")} == {
            "kind": "session",
            "method": "GET",
            "status": "pending",
            "session": None,
        }
        assert receipt["idempotency_key"] is None and receipt["fingerprint"] is None
        assert receipt["attempt"] is None
        # the fence moved: an older call is stale, and so is an older session
        assert (await store.admit(call(4, key="a"))).code == "stale_fence"
        stale = await store.admit(session(4))
        assert isinstance(stale, Refused) and stale.code == "stale_fence"
        refused = (await store.get_receipt(stale.receipt_id)).to_json()
        assert (refused["kind"], refused["status"]) == ("session", "rejected")
        # a call is a call
        plain = await store.admit(call(5, key="b"))
        assert (await store.get_receipt(plain.receipt_id)).to_json()["kind"] == "call"

    async def test_two_sessions_of_one_fence_both_open(self, store) -> None:
        first, second = await store.admit(session(3)), await store.admit(session(3))
        assert isinstance(first, Admitted) and isinstance(second, Admitted)

    async def test_open_then_closed(self, store) -> None:
        opened = await store.admit(session(2))
        record = SessionRecord(opened_at=1_000.0)
        await store.session_opened(opened.receipt_id, record)
        receipt = (await store.get_receipt(opened.receipt_id)).to_json()
        assert (receipt["status"], receipt["http_status"]) == ("pending", 101)
        assert receipt["session"] == record.to_json()
        closed = dataclasses.replace(record, messages_in=3, bytes_in=30, messages_out=1).closed(
            ended_by_gateway("fenced"), 1_002.0
        )
        await store.complete(
            opened.receipt_id,
            Outcome("succeeded", http_status=101, forwarded_at=1_000.0, session=closed),
        )
        receipt = (await store.get_receipt(opened.receipt_id)).to_json()
        assert (receipt["status"], receipt["http_status"]) == ("succeeded", 101)
        assert receipt["session"] == {
            "opened_at": rfc3339(1_000.0),
            "closed_at": rfc3339(1_002.0),
            "closed_by": "fenced",
            "close_code": 4409,
            "messages_in": 3,
            "messages_out": 1,
            "bytes_in": 30,
            "bytes_out": 0,
        }

    async def test_an_outcome_without_a_session_object_keeps_the_opened_one(self, store) -> None:
        opened = await store.admit(session(2))
        await store.session_opened(opened.receipt_id, SessionRecord(opened_at=5.0))
        await store.complete(opened.receipt_id, Outcome("outcome_unknown", error="x"))
        receipt = (await store.get_receipt(opened.receipt_id)).to_json()
        assert receipt["session"]["opened_at"] == rfc3339(5.0)

    async def test_a_refused_upgrade_is_failed_without_a_session_object(self, store) -> None:
        opened = await store.admit(session(2))
        await store.complete(
            opened.receipt_id, Outcome("failed", http_status=403, forwarded_at=1.0)
        )
        receipt = (await store.get_receipt(opened.receipt_id)).to_json()
        assert (receipt["status"], receipt["http_status"], receipt["session"]) == (
            "failed",
            403,
            None,
        )

    async def test_a_rejection_before_admission_can_be_a_session_s(self, store) -> None:
        rejected = await store.reject(
            Rejection("acct/1", 3, None, None, "tool", "GET", "/ws", "missing_fence", 428,
                      kind="session")
        )  # fmt: skip
        assert (await store.get_receipt(rejected)).to_json()["kind"] == "session"


class TestWatchAndAge:
    async def test_fence_states_in_one_read(self, store) -> None:
        taken = await store.acquire("gw/1", "run-a", 30, 0, None, None)
        await store.admit(session(taken.lease.fence, resource="gw/1", issuer="gateway"))
        await store.admit(session(7, resource="ext/1"))
        states = await store.fence_states(["gw/1", "ext/1", "nobody/1"])
        assert states == {
            "gw/1": FenceState(taken.lease.fence, taken.lease.fence, True),
            "ext/1": FenceState(7, None, False),
        }
        await store.release("gw/1", "run-a", taken.lease.fence)
        assert (await store.fence_states(["gw/1"]))["gw/1"].lease_live is False
        assert await store.fence_states([]) == {}

    async def test_an_old_open_session_is_not_lost_while_its_instance_lives(self, store) -> None:
        old_call = await store.admit(call(1, key="old"))
        open_session = await store.admit(session(1))
        await store.heartbeat()
        # open: in flight in its process (one that ended with its outcome unrecorded is lost)
        lost = await store.expire_pending(NO_WAIT, 3600, frozenset({open_session.receipt_id}))
        assert lost == {"tool": 1}
        assert (await store.get_receipt(old_call.receipt_id)).status == "outcome_unknown"
        assert (await store.get_receipt(open_session.receipt_id)).status == "pending"
        # a silent instance's sessions are lost like its calls
        await store.expire_pending(NO_WAIT, -1, frozenset())
        assert (await store.get_receipt(open_session.receipt_id)).status == "outcome_unknown"


class TestSqliteSchema:
    """A database written before sessions existed is migrated in place; a newer one is
    refused."""

    async def test_an_older_database_is_migrated(self, tmp_path: Path) -> None:
        path = tmp_path / "gw.db"
        first = SqliteStore(path, instance="one")
        await first.open()
        admitted = await first.admit(call(3))
        await first.close()
        with sqlite3.connect(path) as conn:  # back to the schema before version 2
            _back_to_version_7(conn)
            conn.execute("ALTER TABLE receipts DROP COLUMN trace_id")  # version 6's (§21)
            conn.execute("ALTER TABLE receipts DROP COLUMN mcp")  # version 3's
            conn.execute("DROP TABLE checkpoints")  # version 4's
            conn.execute("DROP TABLE fence_floor")  # version 5's (docs/contract.md §18)
            conn.execute("DROP TABLE fence_raises")
            conn.execute("ALTER TABLE fences DROP COLUMN lifted")
            conn.execute("ALTER TABLE receipts DROP COLUMN session")
            conn.execute("ALTER TABLE receipts DROP COLUMN kind")
            conn.execute("PRAGMA user_version = 0")
        second = SqliteStore(path, instance="two")
        await second.open()
        try:
            receipt = await second.get_receipt(admitted.receipt_id)
            assert (receipt.kind, receipt.session, receipt.status, receipt.trace_id) == (
                "call",
                None,
                "outcome_unknown",
                None,
            )
            assert isinstance(await second.admit(session(3)), Admitted)
            # its key came along: the call's receipt still holds it
            assert (await second.admit(call(3))).code == "outcome_unknown"
        finally:
            await second.close()
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION

    async def test_keys_move_from_their_table_onto_their_receipts(self, tmp_path: Path) -> None:
        """Version 8: each key's state, in flight, settled (with its expiry) or retried after
        a failure, is its latest receipt's, as the table of version 7 held it."""
        path = tmp_path / "gw.db"
        first = SqliteStore(path, instance="one")
        await first.open()
        settled = await first.admit(call(1, key="settled"))
        await first.complete(settled.receipt_id, ok())
        failed = await first.admit(call(1, key="retried"))
        await first.complete(failed.receipt_id, ok(503))  # a retry status: a new attempt
        retried = await first.admit(call(1, key="retried"))
        in_flight = await first.admit(call(1, key="in-flight"))
        await first.close()
        key_sql = "SELECT resource, key, receipt_id, retention_s, expires_at FROM idempotency_keys"
        with sqlite3.connect(path) as conn:
            before = sorted(conn.execute(key_sql).fetchall())
            _back_to_version_7(conn)
            assert sorted(conn.execute(key_sql).fetchall()) == before
            conn.execute("PRAGMA user_version = 7")
        assert [row[2] for row in before] == [
            in_flight.receipt_id,
            retried.receipt_id,
            settled.receipt_id,
        ]
        assert before[2][4] is not None and before[0][4] is None  # settled: it expires
        second = SqliteStore(path, instance="two")
        await second.open()
        try:
            replayed = await second.admit(call(1, key="settled"))
            assert isinstance(replayed, Replayed) and replayed.receipt_id == settled.receipt_id
            for key in ("retried", "in-flight"):  # pending when the first process stopped
                assert (await second.admit(call(1, key=key))).code == "outcome_unknown"
        finally:
            await second.close()
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
            assert sorted(conn.execute(key_sql).fetchall()) == before

    async def test_a_newer_schema_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / "gw.db"
        store = SqliteStore(path, instance="one")
        await store.open()
        await store.close()
        with sqlite3.connect(path) as conn:
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
        with pytest.raises(SchemaTooNew):
            await SqliteStore(path, instance="two").open()


def _back_to_version_7(conn: sqlite3.Connection) -> None:
    """A database of this gateway as version 7 kept it: its keys in a table of their own, and
    its receipts found for retention by when they completed."""
    conn.execute(
        "CREATE TABLE keys_v7 (resource TEXT NOT NULL, key TEXT NOT NULL, "
        "receipt_id TEXT NOT NULL, retention_s REAL NOT NULL, expires_at REAL, "
        "PRIMARY KEY (resource, key)) WITHOUT ROWID"
    )
    conn.execute("INSERT INTO keys_v7 SELECT * FROM idempotency_keys")  # the view's rows
    conn.execute("DROP VIEW idempotency_keys")
    conn.execute("ALTER TABLE keys_v7 RENAME TO idempotency_keys")
    conn.execute(
        "CREATE INDEX keys_by_expiry ON idempotency_keys (expires_at) WHERE expires_at IS NOT NULL"
    )
    conn.execute(
        "CREATE INDEX receipts_by_completion ON receipts (status, completed_at) "
        "WHERE completed_at IS NOT NULL"
    )
    conn.execute("ALTER TABLE receipts DROP COLUMN key_expires_at")
    conn.execute("ALTER TABLE receipts DROP COLUMN key_retention_s")
