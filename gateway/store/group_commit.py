"""Group commit on one SQLite connection: many operations, one transaction, one fsync.

Operations are plain functions `op(conn) -> result` run in the writer thread. While one batch
commits, new operations queue up; the next batch takes them all. The operations of a batch run
one after the other in one transaction; when one of them fails (rare: a bug, a constraint, a
full disk), the batch is rolled back and run again with each operation inside its own
SAVEPOINT, so that the failing one is rolled back alone and the rest still commit. Operations
only read and write the database (they may be run twice; only the committed run counts), so
the common batch pays for no SAVEPOINT at all. Every
caller is answered only after the COMMIT of its batch returned, i.e. after the fsync when
`synchronous=FULL`: that is the durability promise of `strict` mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from gateway.core.errors import StoreUnavailable

Op = Callable[[sqlite3.Connection], Any]


@dataclass(slots=True)
class _Pending:
    op: Op
    durable: bool
    future: asyncio.Future[Any]


_STOP = None  # put on the queue: the writer loop ends


class GroupCommitter:
    """The writer loop runs in the executor's one thread for as long as the store is open:
    it takes what has queued up, commits it, and hands all the answers of a batch back to the
    event loop in one callback. A call costs one put on a C queue and a share of one wake-up
    of the event loop, with no executor job, concurrent future or asyncio task per batch."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        executor: ThreadPoolExecutor,
        *,
        relaxed: bool,
        before_commit: Callable[[], None] = lambda: None,
        between_batches: Callable[[], None] = lambda: None,
        max_batch: int = 512,
    ) -> None:
        self._conn = conn
        self._executor = executor
        self._relaxed = relaxed
        self._before_commit = before_commit
        self._between_batches = between_batches
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: asyncio.Future[None] | None = None
        self.batches = 0  # for tests and benchmarks: how many commits served the calls

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._writer = self._loop.run_in_executor(self._executor, self._serve)

    async def stop(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            self._queue.put(_STOP)
            await asyncio.gather(writer, return_exceptions=True)
            await asyncio.sleep(0)  # the last batch's answers, handed over by call_soon
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if pending is not None and not pending.future.done():
                pending.future.set_exception(StoreUnavailable("the store is closing"))

    async def submit(self, op: Op, *, durable: bool = False) -> Any:
        """Run `op` in the next batch; returns once that batch is committed.

        `durable` forces an fsync for this batch even in relaxed mode (lease acquires).
        """
        if self._writer is None or self._loop is None:
            raise StoreUnavailable("the store is not open")
        future = self._loop.create_future()
        self._queue.put(_Pending(op, durable, future))
        return await future

    def _serve(self) -> None:
        """The writer thread: batch, commit, answer; until `_STOP`."""
        loop, take, more = self._loop, self._queue.get, self._queue.get_nowait
        assert loop is not None
        while True:
            try:
                first = take(timeout=0.5)
            except queue.Empty:
                if loop.is_closed():  # never stopped: let the interpreter exit
                    return
                continue
            if first is None:
                return
            batch = [first]
            stopping = False
            while len(batch) < self._max_batch:
                try:
                    pending = more()
                except queue.Empty:
                    break
                if pending is None:
                    stopping = True
                    break
                batch.append(pending)
            try:
                results = self._commit(batch)
            except sqlite3.Error as exc:
                failure = StoreUnavailable(f"the store could not commit: {exc}")
                results = [(False, failure)] * len(batch)
            except Exception as exc:
                results = [(False, exc)] * len(batch)
            try:
                loop.call_soon_threadsafe(self._answer, batch, results)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return
            if stopping:
                return
            # after the answers are on their way: upkeep holds up the next batch only; one
            # that failed (a checkpoint) is tried again after the next batches
            with contextlib.suppress(sqlite3.Error):
                self._between_batches()

    def _answer(self, batch: list[_Pending], results: list[tuple[bool, Any]]) -> None:
        self.batches += 1
        for pending, (ok, value) in zip(batch, results, strict=True):
            if pending.future.done():
                continue
            if ok:
                pending.future.set_result(value)
            else:
                pending.future.set_exception(value)

    def _commit(self, batch: list[_Pending]) -> list[tuple[bool, Any]]:
        conn = self._conn
        force_sync = self._relaxed and any(p.durable for p in batch)
        if force_sync:
            conn.execute("PRAGMA synchronous=FULL")
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                try:
                    results = [(True, pending.op(conn)) for pending in batch]
                except Exception:
                    # one of them failed: undo them all and run them again, each in its own
                    # SAVEPOINT, so that only the failing one is rolled back
                    if conn.in_transaction:
                        conn.rollback()
                    conn.execute("BEGIN IMMEDIATE")
                    results = self._isolated(conn, batch)
                self._before_commit()
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.rollback()
                raise
        finally:
            if force_sync:
                conn.execute("PRAGMA synchronous=NORMAL")
        return results

    @staticmethod
    def _isolated(conn: sqlite3.Connection, batch: list[_Pending]) -> list[tuple[bool, Any]]:
        results: list[tuple[bool, Any]] = []
        for pending in batch:
            conn.execute("SAVEPOINT op")
            try:
                results.append((True, pending.op(conn)))
            except Exception as exc:
                conn.execute("ROLLBACK TO op")
                if isinstance(exc, sqlite3.Error):
                    exc = StoreUnavailable(f"the store failed: {exc}")
                results.append((False, exc))
            conn.execute("RELEASE op")
        return results
