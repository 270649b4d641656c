"""Per-resource ordering of fenced calls inside one gateway process (docs/contract.md §3,
"Ordering on takeover").

Two rules:
* takeover: an admitted call waits, before it is forwarded, until the calls of the same
  resource with a *lower* fence that were in flight when it was admitted have left, so the
  tool never sees the new owner's call overtaken by the old owner's. A call registers its
  fence before admission: whichever call of two is admitted first, the later one either waits
  for it or is refused as stale.
* serial: calls of a `concurrency: serial` resource take turns, in arrival order.

Lanes live in memory and vanish when a resource has no call; the fences themselves are in the
store. A lane is per process, which is exact on SQLite (one process per database). With
several processes on one store (docs/contract.md §14) the store also says, at admission,
whether calls that must go first are pending on another process (`Admitted.ahead`): the call
then waits for the store to see them gone, looking again after a short pause that doubles.

An open session (docs/contract.md §15) keeps its place, with its fence registered, for as long
as it is open: it is a call in flight. It can be cut: when a higher fence is admitted for its
resource, `cut_below` tells it to stop relaying and close, and the newer call then waits for
it to leave like for any older call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.core.sessions import ClosedBy
from gateway.store.base import Admitted, Call, Store, StoreUnavailable

# Pauses between looks at the store for calls pending on other processes: a takeover there is
# rare, and the first look usually finds the way clear (the local lane waited first).
STORE_POLL_FIRST_S = 0.005
STORE_POLL_MAX_S = 0.05


class Lane:
    __slots__ = ("cuttable", "fences", "registered", "turn", "users", "waiters")

    def __init__(self) -> None:
        self.registered: set[Place] = set()  # the calls whose fence is registered
        # their fences, each with how many hold it: whether any is lower than a fence is a
        # look at the few distinct ones, not at every call in flight (a hot resource's many)
        self.fences: dict[int, int] = {}
        self.cuttable: set[Place] = set()  # the places of open sessions: what a cut cuts
        self.turn = asyncio.Lock()  # FIFO: asyncio.Lock wakes waiters in arrival order
        self.waiters: list[asyncio.Future[None]] = []
        self.users = 0


class Lanes:
    def __init__(self) -> None:
        self._lanes: dict[str, Lane] = {}
        # calls waiting for their turn in a serial resource: in progress, but doing nothing
        # until the call ahead is done (gateway.store.group_commit counts the calls at work)
        self.waiting_turns = 0

    def __len__(self) -> int:
        return len(self._lanes)

    def join(self, resource: str) -> Place:
        """A call's place in `resource`'s lane, for `async with`: on the way out the call
        leaves it, and the lane goes once no call is in it. (A class, not a generator: this
        is on every fenced call's path.)"""
        lane = self._lanes.get(resource)
        if lane is None:
            lane = self._lanes[resource] = Lane()
        lane.users += 1
        return Place(lane, self, resource)

    def forget(self, resource: str) -> None:
        """The resource's last call left its lane."""
        del self._lanes[resource]


class Place:
    """One call's place in its resource's lane: its turn, its registered fence."""

    __slots__ = ("_cut", "_lane", "_lanes", "_resource", "_turn_taken", "fence")

    def __init__(self, lane: Lane, lanes: Lanes, resource: str) -> None:
        self._lane = lane
        self._lanes = lanes
        self._resource = resource
        self.fence: int | None = None
        self._turn_taken = False
        self._cut: Callable[[ClosedBy], None] | None = None

    async def __aenter__(self) -> Place:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.leave()
        lane = self._lane
        lane.users -= 1
        if lane.users == 0:
            self._lanes.forget(self._resource)

    @property
    def cut(self) -> Callable[[ClosedBy], None] | None:
        """An open session's: what ends it."""
        return self._cut

    @cut.setter
    def cut(self, cut: Callable[[ClosedBy], None] | None) -> None:
        self._cut = cut
        if cut is None:
            self._lane.cuttable.discard(self)
        else:
            self._lane.cuttable.add(self)

    async def take_turn(self, timeout_s: float) -> bool:
        """Wait for this call's turn in a serial resource; False when `timeout_s` passed."""
        lanes = self._lanes
        lanes.waiting_turns += 1
        try:
            async with asyncio.timeout(timeout_s):
                await self._lane.turn.acquire()
        except TimeoutError:
            return False
        finally:
            lanes.waiting_turns -= 1
        self._turn_taken = True
        return True

    def release_turn(self) -> None:
        """Let the next serial call go while this one stays registered: a session that is
        open holds its fence in the lane, not the resource's turn."""
        if self._turn_taken:
            self._turn_taken = False
            self._lane.turn.release()

    def cut_below(self, fence: int) -> None:
        """A call or session of `fence` was admitted: every open session of the resource
        with a lower fence stops relaying now (docs/contract.md §15)."""
        for other in list(self._lane.cuttable):
            if other._cut is not None and other.fence is not None and other.fence < fence:
                other._cut("fenced")

    def register(self, fence: int) -> None:
        lane = self._lane
        self._unregister()
        self.fence = fence
        lane.registered.add(self)
        lane.fences[fence] = lane.fences.get(fence, 0) + 1

    def _unregister(self) -> None:
        lane, fence = self._lane, self.fence
        if fence is not None:
            lane.registered.discard(self)
            if lane.fences[fence] == 1:
                del lane.fences[fence]
            else:
                lane.fences[fence] -= 1
            self.fence = None

    def leave(self) -> None:
        """No longer in flight: wake the calls with newer fences that wait for this one."""
        lane = self._lane
        lane.cuttable.discard(self)
        if self.fence is not None:
            self._unregister()
            waiters, lane.waiters = lane.waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        if self._turn_taken:
            self._turn_taken = False
            lane.turn.release()

    def older(self) -> set[Place]:
        """The calls with a lower fence registered now. Called once this call is admitted:
        a lower fence registered later can only be refused as stale, so it is not waited for
        (else a fenced-out owner sending in a loop could keep the new owner out)."""
        if self.fence is None:
            raise RuntimeError("register the fence first")
        fence = self.fence
        if min(self._lane.fences) >= fence:  # this call's own fence is among them
            return set()
        return {
            other
            for other in self._lane.registered
            if other.fence is not None and other.fence < fence
        }

    async def wait_for(self, older: set[Place], timeout_s: float) -> bool:
        """Wait until every call of `older` has left; False when `timeout_s` passed."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                while older & self._lane.registered:
                    waiter = loop.create_future()
                    self._lane.waiters.append(waiter)
                    await waiter
        except TimeoutError:
            return False
        return True


async def clear_to_forward(
    place: Place, timeout_s: float, store: Store, call: Call, admitted: Admitted
) -> str | None:
    """Takeover order for an admitted call, whatever its rule's concurrency (a resource may be
    served by a serial and a parallel rule at once), and a serial call's turn across
    processes. None when it may go; else why it may not (`resource_busy`,
    `store_unavailable`, `settled_while_waiting`: its receipt is no longer `pending`), and it
    is then never sent.

    A call that had to wait leaves later than its admission said: its `forwarded_at` is
    moved to now, durably, before it leaves, so that a reconciler's grace never ends while
    the call may still be running at the tool.
    """
    older = place.older()
    if not older and not admitted.ahead:
        return None  # nearly every call
    deadline = asyncio.get_running_loop().time() + timeout_s
    if older and not await place.wait_for(older, timeout_s):
        return "resource_busy"
    try:
        if admitted.ahead and not await _clear_in_store(store, call, admitted, deadline):
            return "resource_busy"
        if not await store.mark_forwarded(admitted.receipt_id):
            return "settled_while_waiting"
    except StoreUnavailable:
        return "store_unavailable"
    return None


async def _clear_in_store(store: Store, call: Call, admitted: Admitted, deadline: float) -> bool:
    """Wait until the store has no call pending that must go before this one; False at the
    deadline."""
    loop = asyncio.get_running_loop()
    pause = STORE_POLL_FIRST_S
    while await store.pending_ahead(call.resource, call.fence, admitted.turn):
        if loop.time() + pause > deadline:
            return False
        await asyncio.sleep(pause)
        pause = min(2 * pause, STORE_POLL_MAX_S)
    return True
