"""The backlog of heads that came while the process was full (gateway.wire.backlog): taken in
arrival order, at most `per_turn` in one turn of the event loop, and never stranded."""

from __future__ import annotations

import asyncio

import pytest

from gateway.wire.backlog import Backlog


async def turn() -> None:
    """Let one turn of the loop run what the last one scheduled."""
    await asyncio.sleep(0)


async def test_heads_are_served_in_arrival_order_a_slice_per_turn() -> None:
    served: list[int] = []
    backlog = Backlog(lambda: True, per_turn=3)
    for n in range(7):
        backlog.add(lambda n=n: served.append(n))
    assert served == [] and len(backlog) == 7  # not where they were read
    seen = []
    for _ in range(4):
        await turn()
        seen.append(list(served))
    assert seen == [[0, 1, 2], [0, 1, 2, 3, 4, 5], list(range(7)), list(range(7))]
    assert len(backlog) == 0


async def test_a_head_added_while_a_slice_is_served_waits_for_a_later_turn() -> None:
    served: list[str] = []
    backlog = Backlog(lambda: True, per_turn=10)

    def first() -> None:
        served.append("first")
        backlog.add(lambda: served.append("later"))

    backlog.add(first)
    await turn()
    assert served == ["first"]
    await turn()
    assert served == ["first", "later"]


async def test_a_head_that_fails_leaves_the_others_served() -> None:
    served: list[int] = []
    errors: list[object] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: errors.append(context.get("exception")))
    try:
        backlog = Backlog(lambda: True, per_turn=2)

        def broken() -> None:
            raise RuntimeError("a bug")

        backlog.add(broken)
        for n in range(3):
            backlog.add(lambda n=n: served.append(n))
        for _ in range(3):
            await turn()
    finally:
        loop.set_exception_handler(None)
    assert served == [0, 1, 2]
    assert [type(error) for error in errors] == [RuntimeError]


@pytest.mark.parametrize("full", [True, False])
async def test_heads_wait_only_while_the_process_is_full(full: bool) -> None:
    assert Backlog(lambda: full).holds() is full
