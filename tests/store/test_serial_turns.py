"""A serial resource's next call goes as soon as the last one's outcome is safely on its way,
on every backend, and its admission never overtakes that outcome (docs/contract.md §3,
"Ordering on takeover")."""

import asyncio
from dataclasses import replace

from aiohttp import web

from gateway.proxy import appkeys
from gateway.proxy.failpoints import Failpoints
from gateway.proxy.forward import _record_over
from gateway.proxy.ordering import Lanes
from gateway.store.base import Call, Store
from tests.store.test_contract import call, ok


def _serial(key: str) -> Call:
    return replace(call(1, resource="ser/1", key=key), serial=True)


def _app(store: Store) -> web.Application:
    app = web.Application()
    app[appkeys.STORE] = store
    app[appkeys.FAILPOINTS] = Failpoints({})
    return app


async def test_the_next_call_goes_once_the_outcome_is_on_its_way(store: Store) -> None:
    app, lanes = _app(store), Lanes()
    first_admitted = await store.admit(_serial("first"))
    async with lanes.join("ser/1") as first, lanes.join("ser/1") as second:
        assert await first.take_turn(1)
        recording = asyncio.create_task(
            _record_over(app, first, first_admitted.receipt_id, ok(), over=True)
        )
        assert await second.take_turn(1)
        # where writes commit in order, the outcome is still being written; elsewhere the
        # next call waited for it
        assert recording.done() is not store.writes_in_order
        second_admitted = await store.admit(_serial("second"))
        assert second_admitted.ahead is False  # nothing of the resource is pending before it
        receipt = await store.get_receipt(first_admitted.receipt_id)
        assert receipt is not None and receipt.status == "succeeded"
        assert await recording


async def test_a_streamed_answer_keeps_the_turn(store: Store) -> None:
    """Its body is still coming from the tool: the exchange is not over."""
    app, lanes = _app(store), Lanes()
    admitted = await store.admit(_serial("first"))
    async with lanes.join("ser/1") as first, lanes.join("ser/1") as second:
        assert await first.take_turn(1)
        assert await _record_over(app, first, admitted.receipt_id, ok(), over=False)
        assert not await second.take_turn(0.05)
        first.release_turn()
        assert await second.take_turn(1)
