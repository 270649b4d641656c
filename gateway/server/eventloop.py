"""The event loop the gateway runs on: uvloop when it is installed (the `speed` extra), else
asyncio's own. uvloop's transports and timers are written in C; under load they take a third
or more off the event loop's own share of each call. Nothing in the gateway depends on which
loop it got."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run`, on uvloop when installed."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
