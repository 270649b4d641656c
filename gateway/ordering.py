"""Per-resource ordering of fenced calls inside one gateway process (SPEC 3, "Ordering").

Two rules:
* takeover: a call waits, before it is forwarded, until no call of the same resource with
  a *lower* fence is still in flight, so the tool never sees the new owner's call overtaken by
  the old owner's. A call registers its fence before admission: whichever call of two is
  admitted first, the later one either waits for it or is refused as stale.
* serial: calls of a `concurrency: serial` resource take turns, in arrival order.

Lanes live in memory and vanish when a resource has no call; the fences themselves are in the
store. A lane is per process, which is exact on SQLite (one process per database).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.store.base import Store


class _Lane:
    __slots__ = ("fences", "turn", "users", "waiters")

    def __init__(self) -> None:
        self.fences: Counter[int] = Counter()
        self.turn = asyncio.Lock()  # FIFO: asyncio.Lock wakes waiters in arrival order
        self.waiters: list[asyncio.Future[None]] = []
        self.users = 0


class Lanes:
    def __init__(self) -> None:
        self._lanes: dict[str, _Lane] = {}

    def __len__(self) -> int:
        return len(self._lanes)

    @asynccontextmanager
    async def lane(self, resource: str) -> AsyncIterator[Lane]:
        lane = self._lanes.get(resource)
        if lane is None:
            lane = self._lanes[resource] = _Lane()
        lane.users += 1
        handle = Lane(lane)
        try:
            yield handle
        finally:
            handle.leave()
            lane.users -= 1
            if lane.users == 0:
                del self._lanes[resource]


class Lane:
    """One call's view of its resource's lane."""

    __slots__ = ("_fence", "_lane", "_turn_taken")

    def __init__(self, lane: _Lane) -> None:
        self._lane = lane
        self._fence: int | None = None
        self._turn_taken = False

    async def take_turn(self, timeout_s: float) -> bool:
        """Wait for this call's turn in a serial resource; False when `timeout_s` passed."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._lane.turn.acquire()
        except TimeoutError:
            return False
        self._turn_taken = True
        return True

    def register(self, fence: int) -> None:
        self._fence = fence
        self._lane.fences[fence] += 1

    def leave(self) -> None:
        """No longer in flight: wake the calls with newer fences that wait for this one."""
        lane = self._lane
        if self._fence is not None:
            lane.fences[self._fence] -= 1
            if lane.fences[self._fence] == 0:
                del lane.fences[self._fence]
            self._fence = None
            waiters, lane.waiters = lane.waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        if self._turn_taken:
            self._turn_taken = False
            lane.turn.release()

    def has_older(self) -> bool:
        """A call with a lower fence is in flight: forwarding this one must wait."""
        if self._fence is None:
            raise RuntimeError("register the fence first")
        return min(self._lane.fences) < self._fence

    async def wait_for_older(self, timeout_s: float) -> bool:
        """Wait until no call with a lower fence is in flight; False when `timeout_s` passed."""
        lane, fence = self._lane, self._fence
        if fence is None:
            raise RuntimeError("register the fence first")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                while min(lane.fences) < fence:
                    waiter = loop.create_future()
                    lane.waiters.append(waiter)
                    await waiter
        except TimeoutError:
            return False
        return True


async def clear_to_forward(lane: Lane, timeout_s: float, store: Store, receipt_id: str) -> bool:
    """Takeover order for an admitted call, whatever its rule's concurrency (a resource may be
    served by a serial and a parallel rule at once). False when older calls stayed in flight.

    A call that had to wait leaves later than its admission said: its `forwarded_at` is
    moved to now, durably, before it leaves, so that a reconciler's grace never ends while
    the call may still be running at the tool.
    """
    if not lane.has_older():
        return True
    if not await lane.wait_for_older(timeout_s):
        return False
    await store.mark_forwarded(receipt_id)
    return True
