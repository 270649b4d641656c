"""Outcomes recorded together on PostgreSQL (`record_outcomes`, schema version 10).

The outcome of a `pending` receipt is the last write of nearly every call, and alone it costs
a round trip, a statement and a commit, in the gateway's CPU and the server's. Outcomes that
arrive while a batch is at the server wait for it and go in the next one, all of them in one
statement and one commit: with one call at a time each goes at once, by itself; under load, as
many go together as arrived during the last round trip. No timer holds an outcome back. Each
caller is answered when the commit of its batch has returned, as it was by its own: no answer
leaves before its outcome is durable (docs/contract.md §3).

A batch refused for what it was sent (a value the server or asyncpg would not take, not a
lost connection) is asked again one outcome at a time, so that an outcome whose values fail
fails alone, never its neighbours. An outcome whose caller has gone (cancelled) is recorded
all the same: it is the call's, and the call happened.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Sequence
from operator import itemgetter
from typing import Any

Row = tuple[Any, ...]  # one outcome's arguments to `record_outcomes`, the receipt's id first
_Waiting = tuple[Row, "asyncio.Future[bool]"]


class OutcomeBatches:
    """`record` sends the rows of one batch and returns the ids it recorded; `alone_after`
    says whether the error a batch failed with may be one row's own (each is then sent
    alone), rather than one they all meet (a lost connection: each gets it)."""

    def __init__(
        self,
        record: Callable[[Sequence[Row]], Awaitable[Collection[str]]],
        alone_after: Callable[[BaseException], bool],
        *,
        max_batch: int = 64,
    ) -> None:
        self._record = record
        self._alone_after = alone_after
        self._max_batch = max_batch
        self._waiting: list[_Waiting] = []
        self._sending: asyncio.Task[None] | None = None
        self.batches = 0  # for tests and benchmarks: the statements the outcomes took

    async def record(self, row: Row) -> bool:
        """Record `row` with the outcomes waiting beside it; whether its receipt was still
        `pending`, and so took it."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append((row, future))
        if self._sending is None:
            self._sending = asyncio.ensure_future(self._send_all())
        return await future

    async def _send_all(self) -> None:
        try:
            while self._waiting:
                batch = self._waiting[: self._max_batch]
                del self._waiting[: self._max_batch]
                await self._send(batch)
        finally:
            self._sending = None

    async def _send(self, batch: list[_Waiting]) -> None:
        try:
            # in the order of their receipts' ids, the order in which a sweep locks receipts
            # too: two transactions that lock rows in one order never deadlock
            recorded = await self._record(sorted((row for row, _ in batch), key=itemgetter(0)))
        except Exception as exc:
            if len(batch) > 1 and self._alone_after(exc):
                await asyncio.gather(*(self._send([one]) for one in batch))
                return
            for _, future in batch:
                if not future.done():  # (a caller cancelled: nobody to tell)
                    future.set_exception(exc)
            return
        self.batches += 1
        for row, future in batch:
            if not future.done():
                future.set_result(row[0] in recorded)
