"""One background loop of upkeep: a step every `pause` seconds, for as long as the app is up.

A step that fails is logged (`{name}_failed` when the store is down, the traceback otherwise)
and the next one tries again: upkeep never stops because one pass failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.core import errors
from gateway.observe import logs


async def every(pause: float, step: Callable[[], Awaitable[None]], name: str) -> None:
    while True:
        await asyncio.sleep(pause)
        try:
            await step()
        except errors.StoreUnavailable as exc:
            logs.event(f"{name}_failed", logging.WARNING, error=str(exc))
        except Exception:
            logs.log.exception(f"{name.replace('_', ' ')} failed unexpectedly")
