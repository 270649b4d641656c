"""Proxied calls served by the front (gateway.wire.front) take the path aiohttp's would: the
same edge (`problems`, `authenticate`), the same handler, the same overload limit; only the
request and the reply are the front's, not aiohttp's objects (docs/contract.md §5, §11).

Which calls are the front's: those the app's router sends to the proxy handler (any path not
under `/_gateway/`) to an upstream that is mounted and does not speak MCP (an MCP POST reads
and answers JSON-RPC, which the front leaves to aiohttp's request). A target the mount table
does not route is aiohttp's too: it is answered 404 there, as always.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import cast

from aiohttp import web
from multidict import CIMultiDict

from gateway.config.policy import PolicySet
from gateway.observe import logs
from gateway.proxy import appkeys, handler
from gateway.proxy.slot import Slot
from gateway.server import overload
from gateway.server.auth import authenticate
from gateway.server.middleware import problems
from gateway.server.overload import LIMIT, InflightLimit, ShedAnswer
from gateway.wire.backlog import Backlog
from gateway.wire.incoming import Incoming, Reply, whole


def _authenticated(request: web.Request) -> Awaitable[web.StreamResponse]:
    return authenticate(request, handler.handle)


class FrontDispatch:
    """The front's `Dispatch` (gateway.wire.front) for one server."""

    def __init__(
        self,
        app: web.Application,
        aiohttp_protocol: Callable[[Callable[[], None] | None], asyncio.Protocol],
    ) -> None:
        self.app = app
        self._aiohttp_protocol = aiohttp_protocol
        self._policies: PolicySet = app[appkeys.POLICIES]
        self._limit: InflightLimit = app[LIMIT]
        self._loop = asyncio.get_running_loop()
        self.backlog = Backlog(self._limit.full)

    @property
    def retry_after_s(self) -> float:
        return overload.RETRY_AFTER_S  # read each time: tests shorten it

    def serves(self, incoming: Incoming) -> bool:
        if incoming.path.startswith("/_gateway/"):
            return False
        found = self._policies.route(incoming.raw_path.partition("?")[0])
        return found is not None and not found[0].mcp

    def overloaded(self, incoming: Incoming, *, waited: bool = False) -> bool:
        return self._limit.overloaded(incoming.path, waited=waited)

    def admit(self, incoming: Incoming, *, waited: bool = False) -> bytes | None:
        now = self._loop.time()
        verdict = self._limit.admit(
            incoming.method, incoming.raw_path, incoming.path, incoming.headers, now, waited
        )
        if isinstance(verdict, ShedAnswer):
            return verdict.wire(close=incoming.must_close, to_head=incoming.method == "HEAD")
        if verdict:
            incoming[appkeys.SLOT] = Slot(self._limit.done, now)
        return None

    def aiohttp_protocol(self, returned: Callable[[], None] | None = None) -> asyncio.Protocol:
        return self._aiohttp_protocol(returned)

    def call(self, incoming: Incoming) -> asyncio.Task[None]:
        return self._loop.create_task(self._serve(incoming))

    async def _serve(self, incoming: Incoming) -> None:
        # The edge and the call path read it as they read aiohttp's request: what they read
        # of one, it has (gateway.wire.incoming)
        request = cast(web.Request, incoming)
        try:
            response = await problems(request, _authenticated)
            if not isinstance(response, Reply):  # an answer of the gateway's own
                _write_whole(incoming, response)
        except Exception:  # a bug past the edge's own net: the connection cannot go on
            logs.log.exception("unhandled error on %s %s", incoming.method, incoming.path)
            if incoming.transport is not None:
                incoming.transport.abort()
            raise
        finally:
            slot: Slot | None = incoming.get(appkeys.SLOT)
            if slot is not None:  # now answered, unless its slot was given back before
                flow = incoming.get(appkeys.FLOW)
                slot.release(flow.upstream_s if flow is not None else 0.0, self._loop.time())


def _write_whole(incoming: Incoming, response: web.StreamResponse) -> None:
    """Write an answer the edge made (a refusal: problem+json or JSON-RPC). One that comes
    after the reply's head went out cannot be told: the connection is cut instead."""
    transport = incoming.transport
    if transport is None or transport.is_closing():
        return
    if incoming.replied:
        transport.abort()
        return
    if not incoming.content.is_eof():
        incoming.must_close = True  # its body's rest is still coming: no request follows
    # the edge's refusals are `web.Response`s with their body as bytes (middleware)
    assert isinstance(response, web.Response) and isinstance(response.body, bytes)
    transport.write(
        whole(
            response.status,
            CIMultiDict(response.headers),
            response.body,
            close=incoming.must_close,
            to_head=incoming.method == "HEAD",
        )
    )
