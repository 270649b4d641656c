"""Per-resource lanes: takeover order and serial turns, with real tasks."""

import asyncio

from gateway.proxy.ordering import Lanes


class TestTakeover:
    """A newer fence waits for older fences in flight, not for equal or newer ones."""

    async def test_newer_waits_for_older(self) -> None:
        lanes, events = Lanes(), []

        async def call(fence: int, hold: float) -> None:
            async with lanes.join("r") as place:
                place.register(fence)
                assert await place.wait_for(place.older(), 5)
                events.append(("start", fence))
                await asyncio.sleep(hold)
                events.append(("end", fence))

        old = asyncio.create_task(call(1, 0.05))
        await asyncio.sleep(0)
        await call(2, 0)
        await old
        assert events == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
        assert len(lanes) == 0  # lanes are freed when the resource is idle

    async def test_equal_fences_run_together(self) -> None:
        lanes = Lanes()
        async with lanes.join("r") as a, lanes.join("r") as b:
            a.register(3)
            b.register(3)
            assert await b.wait_for(b.older(), 0.01)

    async def test_timeout(self) -> None:
        lanes = Lanes()
        async with lanes.join("r") as old, lanes.join("r") as new:
            old.register(1)
            new.register(2)
            assert not await new.wait_for(new.older(), 0.02)

    async def test_older_calls_registered_after_admission_are_not_waited_for(self) -> None:
        """They can only be refused as stale: a fenced-out owner sending in a loop must not
        keep the new owner out."""
        lanes = Lanes()
        async with lanes.join("r") as old, lanes.join("r") as new:
            old.register(1)
            new.register(2)
            older = new.older()
            old.leave()
            async with lanes.join("r") as stale:
                stale.register(1)  # arrives after the new owner's admission
                assert await new.wait_for(older, 0.01)

    async def test_older_are_exactly_the_lower_fences_in_flight(self) -> None:
        lanes = Lanes()
        async with lanes.join("r") as a, lanes.join("r") as b, lanes.join("r") as c:
            a.register(3)
            b.register(3)
            c.register(5)
            assert c.older() == {a, b}
            assert a.older() == set()
            a.leave()
            assert c.older() == {b}
            b.register(7)  # registered again, with a newer fence: the old one is gone
            assert c.older() == set()
            assert b.older() == {c}


class TestCuts:
    """An admitted fence cuts the open sessions of its resource with a lower fence, and no
    other place."""

    async def test_only_lower_open_sessions_are_cut(self) -> None:
        lanes, cut = Lanes(), []
        async with (
            lanes.join("r") as session,
            lanes.join("r") as newer_session,
            lanes.join("r") as call,
            lanes.join("r") as closed,
            lanes.join("r") as admitted,
        ):
            session.register(1)
            session.cut = lambda by: cut.append(("session", by))
            newer_session.register(4)
            newer_session.cut = lambda by: cut.append(("newer", by))
            call.register(1)  # a call in flight, not a session: nothing to cut
            closed.register(1)
            closed.cut = lambda by: cut.append(("closed", by))
            closed.cut = None  # its session ended
            admitted.register(3)
            admitted.cut_below(3)
        assert cut == [("session", "fenced")]


class TestSerial:
    """Serial turns go one at a time, in arrival order."""

    async def test_fifo(self) -> None:
        lanes, order, running = Lanes(), [], []

        async def call(i: int) -> None:
            async with lanes.join("r") as place:
                assert await place.take_turn(5)
                running.append(i)
                assert len(running) == 1
                order.append(i)
                await asyncio.sleep(0.001)
                running.remove(i)

        await asyncio.gather(*(call(i) for i in range(20)))
        assert order == list(range(20))

    async def test_turn_timeout(self) -> None:
        lanes = Lanes()
        async with lanes.join("r") as first, lanes.join("r") as second:
            assert await first.take_turn(1)
            assert not await second.take_turn(0.02)
        assert lanes.waiting_turns == 0

    async def test_the_calls_waiting_for_their_turn_are_counted(self) -> None:
        """What the SQLite store's group commit subtracts from the calls in progress."""
        lanes = Lanes()
        async with lanes.join("r") as first, lanes.join("r") as second:
            assert await first.take_turn(1)
            assert lanes.waiting_turns == 0  # a free turn is taken at once
            waiting = asyncio.ensure_future(second.take_turn(5))
            await asyncio.sleep(0)
            assert lanes.waiting_turns == 1
            first.release_turn()
            assert await waiting
            assert lanes.waiting_turns == 0
