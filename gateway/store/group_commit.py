"""Group commit on one SQLite connection: many operations, one transaction, one fsync.

Operations are plain functions `op(conn) -> result`. While one batch commits, new operations
queue up; the next batch takes them all. The operations of a batch run one after the other in
one transaction; when one of them fails (rare: a bug, a constraint, a full disk), the batch is
rolled back and run again with each operation inside its own SAVEPOINT, so that the failing
one is rolled back alone and the rest still commit. Operations only read and write the
database (they may be run twice; only the committed run counts), so the common batch pays for
no SAVEPOINT at all. Every caller is answered only after the COMMIT of its batch returned,
i.e. after the fsync when `synchronous=FULL`: that is the durability promise of `strict` mode.

Where each part runs. A batch's operations run on the event loop's thread, its COMMIT (the
WAL's writes and the fsync) in the writer thread. The sqlite3 module lets go of the GIL around
every statement and takes it back after: a writer thread running the statements took it back
some sixty times a batch, each time once the busy loop let go of it (under load, 1.5 ms for
0.4 ms of work, 17 operations), while every call of the batch waited. On the loop's thread
taking it back is never contended; the writer takes it three times a batch (to take the
batch, after the COMMIT, to answer), each within the interpreter's switch interval, which the
server shortens (gateway.server.serve). An operation over many rows (`bulk`: a sweep's
batch, a restore) runs in the writer thread, before the COMMIT, where SQLite's own work goes
on beside the loop's.

A batch that is all the work there is (every call at work, as `active_calls` counts them,
waits in it, and none of its operations is bulk) is committed on the loop's thread itself:
nothing else would run while the writer thread committed it, and the two hand-offs are
saved, each the wake-up of a sleeping thread (one agent's calls one after the other: a fifth
more calls a second here, and a fifth less CPU for each). The WAL's upkeep after such a
batch, when due, still runs in the writer thread. Only calls' own operations (`of_call`)
count as calls waiting in a batch: a heartbeat beside a call at its tool is not that call,
and a commit on the loop would hold up the call's deadline by as long as the fsync takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gateway.core.errors import StoreUnavailable

Op = Callable[[sqlite3.Connection], Any]
Result = tuple[bool, Any]  # (True, what the operation returned) or (False, what it raised)


class _Pending:
    __slots__ = ("bulk", "durable", "future", "of_call", "op", "result")

    def __init__(
        self, op: Op, durable: bool, bulk: bool, of_call: bool, future: asyncio.Future[Any]
    ) -> None:
        self.op = op
        self.durable = durable
        self.bulk = bulk
        self.of_call = of_call
        self.future = future
        self.result: Result | None = None


class _Batch:
    """One transaction's operations, begun on the loop and handed to the writer thread."""

    __slots__ = ("force_sync", "isolate", "pending")

    def __init__(self, pending: list[_Pending], force_sync: bool) -> None:
        self.pending = pending
        self.force_sync = force_sync
        self.isolate = False  # an operation failed: the writer runs them again, one by one


_STOP = None  # put on the writer's queue: the writer loop ends
_UPKEEP = _Batch([], force_sync=False)  # put there after a batch committed on the loop


class GroupCommitter:
    """Batches are made on the event loop, one at a time: the next begins once the writer
    thread has committed the last and is done with the connection (`_next`). A call costs an
    append to a list and its share of a batch's hand-offs: one to the writer, one back (its
    answers and the connection; two when upkeep is due between batches: the answers, then the
    connection once it is done); none for a batch the loop commits itself (`_alone`)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        executor: ThreadPoolExecutor,
        *,
        relaxed: bool,
        before_commit: Callable[[], None] = lambda: None,
        between_batches: Callable[[], None] = lambda: None,
        upkeep_due: Callable[[], bool] = lambda: False,
        active_calls: Callable[[], int] | None = None,
        max_batch: int = 512,
    ) -> None:
        self._conn = conn
        self._executor = executor
        self._relaxed = relaxed
        self._before_commit = before_commit
        self._between_batches = between_batches  # upkeep, in the writer thread
        self._upkeep_due = upkeep_due  # whether `between_batches` has anything to do
        self._active_calls = active_calls  # None: never commit on the loop
        self._max_batch = max_batch
        self._waiting: list[_Pending] = []
        self._busy = False  # a batch is begun, or the writer still holds the connection
        self._batches: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: asyncio.Future[None] | None = None
        self.batches = 0  # for tests and benchmarks: how many commits served the calls

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._writer = self._loop.run_in_executor(self._executor, self._serve)

    async def stop(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            self._batches.put(_STOP)  # after the batch the writer holds, if any
            await asyncio.gather(writer, return_exceptions=True)
            await asyncio.sleep(0)  # the last batch's answers, handed over by call_soon
        waiting, self._waiting = self._waiting, []
        _fail(waiting, StoreUnavailable("the store is closing"))

    async def submit(
        self, op: Op, *, durable: bool = False, bulk: bool = False, of_call: bool = False
    ) -> Any:
        """Run `op` in the next batch; returns once that batch is committed.

        `durable` forces an fsync for this batch even in relaxed mode (lease acquires).
        `bulk`: `op` works on many rows, and runs in the writer thread.
        `of_call`: `op` is a proxied call's own (its admission, refusal or outcome): the call
        waits in this batch, as `_alone` counts the calls at work.
        """
        if self._writer is None or self._loop is None:
            raise StoreUnavailable("the store is not open")
        future = self._loop.create_future()
        self._waiting.append(_Pending(op, durable, bulk, of_call, future))
        if not self._busy:
            self._busy = True
            # soon, not now: what else is ready in this turn of the loop joins the batch, even
            # with one call at work: a serial resource's next admission, whose turn this
            # outcome has just given (begun at once, each went alone: half the calls a commit)
            self._loop.call_soon(self._begin)
        return await future

    # -- on the event loop --------------------------------------------------------------------

    def _begin(self) -> None:
        """Begin the next batch: its transaction and its short operations; the writer thread
        takes it from there."""
        taken = self._waiting[: self._max_batch]
        del self._waiting[: self._max_batch]
        if not taken or self._writer is None:
            self._busy = False
            _fail(taken, StoreUnavailable("the store is closing"))
            return
        conn = self._conn
        batch = _Batch(taken, self._relaxed and any(p.durable for p in taken))
        try:
            if batch.force_sync:
                conn.execute("PRAGMA synchronous=FULL")
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                self._restore_sync(batch)
            _fail(taken, StoreUnavailable(f"the store could not commit: {exc}"))
            self._next()
            return
        try:
            for pending in taken:
                if not pending.bulk:
                    pending.result = (True, pending.op(conn))
        except Exception:
            batch.isolate = True
            with contextlib.suppress(sqlite3.Error):
                conn.rollback()
        if self._alone(taken):
            self._commit_here(batch)
        else:
            self._batches.put(batch)

    def _alone(self, taken: list[_Pending]) -> bool:
        """Whether the batch is all the work there is: every call at work waits in it."""
        counted = self._active_calls
        return (
            counted is not None
            and counted() <= sum(pending.of_call for pending in taken)
            and not any(pending.bulk for pending in taken)
        )

    def _commit_here(self, batch: _Batch) -> None:
        """Commit on the loop's thread and answer; the upkeep, when due, in the writer's."""
        _run_commit(self._commit, batch)
        self._answer(batch)
        if self._upkeep_due():
            self._batches.put(_UPKEEP)
        else:
            self._next()

    def _answer(self, batch: _Batch) -> None:
        self.batches += 1
        for pending in batch.pending:
            if pending.future.done():
                continue
            assert pending.result is not None  # the writer ran it, or failed the batch
            ok, value = pending.result
            if ok:
                pending.future.set_result(value)
            else:
                pending.future.set_exception(value)

    def _answer_then_next(self, batch: _Batch) -> None:
        self._answer(batch)
        self._next()

    def _next(self) -> None:
        """The writer is done with the connection: the next batch, if anything waits."""
        if self._waiting:
            self._begin()
        else:
            self._busy = False

    # -- in the writer thread -----------------------------------------------------------------

    def _serve(self) -> None:
        """The writer thread: finish and commit each batch, answer; until `_STOP`."""
        loop, take = self._loop, self._batches.get
        assert loop is not None
        while True:
            try:
                batch = take(timeout=0.5)
            except queue.Empty:
                if loop.is_closed():  # never stopped: let the interpreter exit
                    return
                continue
            if batch is None:
                return
            try:
                if batch is not _UPKEEP:  # (after a batch the loop committed: upkeep only)
                    _run_commit(self._commit, batch)
                    if not self._upkeep_due():  # one hand-back: the answers, then the next
                        loop.call_soon_threadsafe(self._answer_then_next, batch)
                        continue
                    loop.call_soon_threadsafe(self._answer, batch)
                # after the answers are on their way: upkeep holds up the next batch only;
                # one that failed (a checkpoint) is tried again when it is next due
                with contextlib.suppress(sqlite3.Error):
                    self._between_batches()
                loop.call_soon_threadsafe(self._next)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return

    def _commit(self, batch: _Batch) -> None:
        conn = self._conn
        try:
            if batch.isolate or not self._run_bulk(conn, batch.pending):
                # one of them failed: undo them all and run them again, each in its own
                # SAVEPOINT, so that only the failing one is rolled back
                if conn.in_transaction:
                    conn.rollback()
                conn.execute("BEGIN IMMEDIATE")
                self._isolated(conn, batch.pending)
            self._before_commit()
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise
        finally:
            self._restore_sync(batch)

    def _restore_sync(self, batch: _Batch) -> None:
        if batch.force_sync:
            self._conn.execute("PRAGMA synchronous=NORMAL")

    @staticmethod
    def _run_bulk(conn: sqlite3.Connection, batch: list[_Pending]) -> bool:
        """The batch's bulk operations; False when one failed."""
        try:
            for pending in batch:
                if pending.bulk:
                    pending.result = (True, pending.op(conn))
        except Exception:
            return False
        return True

    @staticmethod
    def _isolated(conn: sqlite3.Connection, batch: list[_Pending]) -> None:
        """Run the operations each in its own SAVEPOINT, so that a failing one is rolled back
        alone. Some failures SQLite answers by rolling the whole transaction back (a full
        disk, a constraint `OR ROLLBACK`), savepoints and all: the transaction is begun again
        and the others run again, without the one that failed."""
        remaining = batch
        while remaining:
            remaining = GroupCommitter._isolated_pass(conn, remaining)

    @staticmethod
    def _isolated_pass(conn: sqlite3.Connection, batch: list[_Pending]) -> list[_Pending]:
        """One pass of `_isolated`; what is to run again in a new transaction (nothing,
        unless a failure ended this one)."""
        for pending in batch:
            conn.execute("SAVEPOINT op")
            try:
                pending.result = (True, pending.op(conn))
            except Exception as exc:
                if isinstance(exc, sqlite3.Error):
                    exc = StoreUnavailable(f"the store failed: {exc}")
                pending.result = (False, exc)
                if not conn.in_transaction:  # SQLite rolled it all back
                    conn.execute("BEGIN IMMEDIATE")
                    return [other for other in batch if other is not pending]
                conn.execute("ROLLBACK TO op")
            conn.execute("RELEASE op")
        return []


def _run_commit(commit: Callable[[_Batch], None], batch: _Batch) -> None:
    """Commit `batch`; when it did not commit, every operation in it failed."""
    try:
        commit(batch)
    except sqlite3.Error as exc:
        _settle(batch.pending, StoreUnavailable(f"the store could not commit: {exc}"))
    except Exception as exc:
        _settle(batch.pending, exc)


def _settle(batch: list[_Pending], error: BaseException) -> None:
    """The batch did not commit: every operation in it failed with `error`."""
    for pending in batch:
        pending.result = (False, error)


def _fail(batch: list[_Pending], error: BaseException) -> None:
    """Answer at once, on the loop, operations no batch will run."""
    for pending in batch:
        if not pending.future.done():
            pending.future.set_exception(error)
