"""Outcomes recorded together (gateway.store.pg_outcomes), against a stand-in for the server
whose round trips the test opens and closes: which outcomes go in which statement, and what
each caller is told."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence

import pytest

from gateway.core.errors import StoreUnavailable
from gateway.store.pg_outcomes import OutcomeBatches, Row


class Refused(Exception):
    """The server refused a statement for what it was sent."""


class Server:
    """Records each statement's rows; answers a statement once the test lets it through
    (`answer`), or at once when `auto`. A row whose id is in `refuse` makes the statement
    fail as refused; one in `gone` is not recorded (its receipt was no longer pending)."""

    def __init__(self, *, auto: bool = False) -> None:
        self.statements: list[list[str]] = []
        self.refuse: set[str] = set()
        self.gone: set[str] = set()
        self.lost = False  # every statement fails as on a lost connection
        self._auto = auto
        self._through: asyncio.Queue[None] = asyncio.Queue()

    async def record(self, rows: Sequence[Row]) -> Collection[str]:
        ids = [row[0] for row in rows]
        self.statements.append(ids)
        if not self._auto:
            await self._through.get()
        if self.lost:
            raise StoreUnavailable("the store failed: connection lost")
        if self.refuse.intersection(ids):
            raise StoreUnavailable("the store failed: refused") from Refused()
        return {i for i in ids if i not in self.gone}

    def answer(self) -> None:
        self._through.put_nowait(None)


def batches(server: Server, max_batch: int = 64) -> OutcomeBatches:
    return OutcomeBatches(
        server.record, lambda exc: isinstance(exc.__cause__, Refused), max_batch=max_batch
    )


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_outcome_alone_goes_at_once_by_itself() -> None:
    server = Server(auto=True)
    assert await batches(server).record(("r1", "succeeded")) is True
    assert server.statements == [["r1"]]


async def test_outcomes_that_arrive_during_a_round_trip_go_together_in_the_next() -> None:
    server = Server()
    outcomes = batches(server)
    first = asyncio.ensure_future(outcomes.record(("r1",)))
    await settle()
    later = [asyncio.ensure_future(outcomes.record((f"r{n}",))) for n in range(2, 7)]
    await settle()
    assert server.statements == [["r1"]]  # the others wait for its answer, no timer
    server.answer()
    assert await first is True
    await settle()
    assert server.statements == [["r1"], ["r2", "r3", "r4", "r5", "r6"]]
    assert not any(t.done() for t in later)  # answered only once their commit returned
    server.answer()
    assert await asyncio.gather(*later) == [True] * 5
    assert outcomes.batches == 2


async def test_each_is_told_whether_its_receipt_took_its_outcome() -> None:
    server = Server(auto=True)
    server.gone = {"r2"}
    outcomes = batches(server)
    assert await asyncio.gather(*(outcomes.record((f"r{n}",)) for n in (1, 2, 3))) == [
        True,
        False,
        True,
    ]
    assert server.statements == [["r1", "r2", "r3"]]  # all ready in one turn of the loop


async def test_a_refused_batch_is_asked_again_one_outcome_at_a_time() -> None:
    server = Server(auto=True)
    server.refuse = {"r3"}
    outcomes = batches(server)
    results = await asyncio.gather(
        *(outcomes.record((f"r{n}",)) for n in range(1, 5)), return_exceptions=True
    )
    assert results[:2] == [True, True] and results[3] is True
    assert isinstance(results[2], StoreUnavailable)  # only the outcome the server refused
    assert server.statements == [["r1", "r2", "r3", "r4"], ["r1"], ["r2"], ["r3"], ["r4"]]


async def test_a_failure_they_all_meet_reaches_each_at_once() -> None:
    server = Server(auto=True)
    server.lost = True
    outcomes = batches(server)
    results = await asyncio.gather(
        *(outcomes.record((f"r{n}",)) for n in range(1, 5)), return_exceptions=True
    )
    assert all(isinstance(r, StoreUnavailable) for r in results)
    assert server.statements == [["r1", "r2", "r3", "r4"]]  # none asked again alone


async def test_a_caller_that_left_leaves_the_others_answered() -> None:
    server = Server()
    outcomes = batches(server)
    first = asyncio.ensure_future(outcomes.record(("r1",)))
    await settle()
    gone, staying = (asyncio.ensure_future(outcomes.record((f"r{n}",))) for n in (2, 3))
    await settle()
    gone.cancel()
    server.answer()
    await settle()
    server.answer()
    assert await first is True and await staying is True
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert server.statements == [["r1"], ["r2", "r3"]]  # its outcome recorded all the same


async def test_a_batch_takes_at_most_max_batch_outcomes() -> None:
    server = Server(auto=True)
    outcomes = batches(server, max_batch=4)
    await asyncio.gather(*(outcomes.record((f"r{n}",)) for n in range(11)))
    assert [len(ids) for ids in server.statements] == [4, 4, 3]
