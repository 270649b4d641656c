"""PostgreSQL records the outcomes ready at the same time in one statement (`record_outcomes`,
schema version 10; gateway.store.pg_outcomes), each as it would be alone (docs/contract.md
§3, "Outcome", §4): on the real server, with outcomes sent at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.core.errors import StoreUnavailable
from gateway.store.base import Admitted, Completion, Outcome
from tests.store.conftest import make_store, pg_database
from tests.store.test_contract import call, ok

asyncpg = pytest.importorskip("asyncpg")

from gateway.store.postgres import PostgresStore  # noqa: E402

CALLS = 40


async def admitted(store: PostgresStore, n: int) -> list[str]:
    ids = []
    for i in range(n):
        each = await store.admit(call(1, key=f"k{i}"))
        assert isinstance(each, Admitted)
        ids.append(each.receipt_id)
    return ids


@pytest.fixture
async def pg_store(tmp_path: Path) -> AsyncIterator[PostgresStore]:
    """A PostgreSQL store alone (the `store` fixture is every backend's)."""
    store = make_store("postgres", tmp_path)
    assert isinstance(store, PostgresStore)
    await store.open()
    yield store
    await store.close()


async def test_outcomes_sent_at_once_share_statements_and_each_keeps_its_own(
    pg_store: PostgresStore, tmp_path: Path
) -> None:
    ids = await admitted(pg_store, CALLS)
    answers = await asyncio.gather(
        *(pg_store.complete(rid, ok(200 + i, b'{"n": %d}' % i)) for i, rid in enumerate(ids))
    )
    assert answers == [Completion.RECORDED] * CALLS
    assert pg_store._outcomes.batches < CALLS / 4  # one statement for many
    for i, rid in enumerate(ids):
        receipt = await pg_store.get_receipt(rid)
        assert receipt is not None
        assert (receipt.status, receipt.http_status, receipt.late) == ("succeeded", 200 + i, False)
    conn = await asyncpg.connect(pg_database(tmp_path))
    try:
        bodies = dict(await conn.fetch("SELECT id, response_body FROM receipts"))
        # every key's retention started, from its own receipt's completion
        settled = await conn.fetchval(
            "SELECT count(*) FROM idempotency_keys k JOIN receipts r ON r.id = k.receipt_id "
            "WHERE k.expires_at = r.completed_at + k.retention_s"
        )
    finally:
        await conn.close()
    assert [bodies[rid] for rid in ids] == [b'{"n": %d}' % i for i in range(CALLS)]
    assert settled == CALLS


async def test_an_outcome_whose_receipt_left_pending_is_decided_alone_beside_the_others(
    pg_store: PostgresStore, tmp_path: Path
) -> None:
    ids = await admitted(pg_store, 6)
    conn = await asyncpg.connect(pg_database(tmp_path))
    try:  # the sweeper gave up on one call meanwhile
        await conn.execute("UPDATE receipts SET status = 'outcome_unknown' WHERE id = $1", ids[2])
    finally:
        await conn.close()
    answers = await asyncio.gather(*(pg_store.complete(rid, ok()) for rid in ids))
    assert answers == [Completion.RECORDED] * 2 + [Completion.LATE] + [Completion.RECORDED] * 3
    late = await pg_store.get_receipt(ids[2])
    assert late is not None and (late.status, late.late) == ("succeeded", True)


@pytest.mark.parametrize(
    "impossible",
    [
        replace(ok(), http_status=2**40),  # asyncpg sends no integer column this
        replace(ok(), error="nul\x00"),  # the server takes no NUL in text
    ],
    ids=["asyncpg-refuses", "server-refuses"],
)
async def test_an_outcome_whose_values_are_refused_fails_alone(
    pg_store: PostgresStore, impossible: Outcome
) -> None:
    ids = await admitted(pg_store, 5)
    answers = await asyncio.gather(
        *(pg_store.complete(rid, impossible if i == 3 else ok()) for i, rid in enumerate(ids)),
        return_exceptions=True,
    )
    assert isinstance(answers[3], StoreUnavailable)
    assert [a for i, a in enumerate(answers) if i != 3] == [Completion.RECORDED] * 4
    left = await pg_store.get_receipt(ids[3])
    assert left is not None and left.status == "pending"
