"""Group commit on one SQLite connection: many operations, one transaction, one fsync.

Operations are plain functions `op(conn) -> result` run in the writer thread. While one batch
commits, new operations queue up; the next batch takes them all. Each operation runs inside
its own SAVEPOINT, so one that fails is rolled back alone and the rest still commit. Every
caller is answered only after the COMMIT of its batch returned, i.e. after the fsync when
`synchronous=FULL`: that is the durability promise of `strict` mode.
"""

from __future__ import annotations

import asyncio
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


class GroupCommitter:
    def __init__(
        self,
        conn: sqlite3.Connection,
        executor: ThreadPoolExecutor,
        *,
        relaxed: bool,
        before_commit: Callable[[], None] = lambda: None,
        max_batch: int = 512,
    ) -> None:
        self._conn = conn
        self._executor = executor
        self._relaxed = relaxed
        self._before_commit = before_commit
        self._max_batch = max_batch
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.batches = 0  # for tests and benchmarks: how many commits served the calls

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="group-commit")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if not pending.future.done():
                pending.future.set_exception(StoreUnavailable("the store is closing"))

    async def submit(self, op: Op, *, durable: bool = False) -> Any:
        """Run `op` in the next batch; returns once that batch is committed.

        `durable` forces an fsync for this batch even in relaxed mode (lease acquires).
        """
        if self._task is None:
            raise StoreUnavailable("the store is not open")
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(op, durable, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                results = await loop.run_in_executor(self._executor, self._commit, batch)
            except sqlite3.Error as exc:
                failure = StoreUnavailable(f"the store could not commit: {exc}")
                results = [(False, failure)] * len(batch)
            except BaseException as exc:
                results = [(False, exc)] * len(batch)
                if not isinstance(exc, Exception):
                    raise
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
        results: list[tuple[bool, Any]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
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
