"""A call's place under `GATEWAY_MAX_INFLIGHT` (docs/contract.md §11, gateway.server.overload),
given back once: when its answer is written (gateway.server.http_server), or as soon as its
answer's head is, for an answer that is the tool's stream from then on (an unfenced MCP
stream: gateway.proxy.mcp). Such a stream stays open for as long as its client listens, and
its length says nothing about how busy the process is, any more than an open session's does.
"""

from __future__ import annotations

from collections.abc import Callable


class Slot:
    __slots__ = ("_done", "_since")

    def __init__(self, done: Callable[[float, float], None], since: float) -> None:
        self._done: Callable[[float, float], None] | None = done  # (the call's own time, now)
        self._since = since  # when its head was parsed (loop time)

    def release(self, upstream_s: float, now: float) -> None:
        """The call's own time is up to `now`, less `upstream_s`, the tool's."""
        done, self._done = self._done, None
        if done is not None:
            done(now - self._since - upstream_s, now)
