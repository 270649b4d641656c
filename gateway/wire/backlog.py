"""Heads that arrive while the process is full wait their turn, a few per turn of the loop
(docs/contract.md §11; the front, gateway.wire.front, is what queues them).

A crowd that arrives at once (two thousand connections opened together, or a crowd shed a
second ago sending again) would otherwise be answered in the turn of the event loop that read
it: a thousand sockets read in one turn, each head parsed and refused right there, and every
call already admitted waits for that whole turn before each of its steps (its admission's
answer, its send, the tool's answer, its outcome, its reply: as many turns as steps). So
while the process is full (`full`), or heads wait already, a connection whose head is whole
is not served where it was read: it joins this queue, and each turn of the loop takes at most
`PER_TURN` connections from it, in arrival order, each served as it would have been when it
came (`waited`: shed, even when a place has come free since, unless its path is one the limit
never counts). What a crowd adds to a turn is then its reads, and one slice of its answers.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

# Heads served per turn of the loop from the queue: each costs about what a shed call costs
# (a parse and a prepared answer), so a turn grows by a millisecond or two at most. Fewer
# leave the admitted calls' latency as it is and delay the crowd's refusals; more lengthen
# the turns the admitted calls wait for (measured: docs/design/performance.md, "Overload").
PER_TURN = 32


class Backlog:
    """The queue of one server's connections whose whole head waits for a turn."""

    __slots__ = ("_full", "_loop", "_per_turn", "_scheduled", "_waiting")

    def __init__(self, full: Callable[[], bool], per_turn: int = PER_TURN) -> None:
        self._full = full  # whether a call now would be shed (the overload limit)
        self._loop = asyncio.get_running_loop()
        self._per_turn = per_turn
        self._waiting: collections.deque[Callable[[], None]] = collections.deque()
        self._scheduled = False

    def __len__(self) -> int:
        return len(self._waiting)

    def holds(self) -> bool:
        """Whether a whole head must wait for its turn: the process is full."""
        return self._full()

    def add(self, serve: Callable[[], None]) -> None:
        """`serve` is called in a later turn of the loop, after those added before it."""
        self._waiting.append(serve)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        waiting = self._waiting
        try:
            for _ in range(min(self._per_turn, len(waiting))):
                waiting.popleft()()
        finally:  # one that raised (a bug) does not strand the others
            if waiting:
                self._loop.call_soon(self._turn)
            else:
                self._scheduled = False
