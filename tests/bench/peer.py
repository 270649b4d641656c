"""The peer the gateway is measured against: the pass-through proxy a user would write instead.

Thirty lines of aiohttp on uvloop (when installed), one ClientSession, hop-by-hop headers
stripped both ways, bodies read whole. `python -m tests.bench.peer UPSTREAM_URL` binds an
ephemeral port on 127.0.0.1 and prints it.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
from aiohttp import web

from gateway.server import eventloop

HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
}  # fmt: skip


def _pass(headers: object) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}  # type: ignore[attr-defined]


async def main(upstream: str) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def proxy(request: web.Request) -> web.Response:
        body = await request.read()
        async with session.request(
            request.method, upstream + request.path_qs, headers=_pass(request.headers), data=body
        ) as answer:
            return web.Response(
                status=answer.status, body=await answer.read(), headers=_pass(answer.headers)
            )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()  # until SIGTERM


if __name__ == "__main__":
    eventloop.run(main(sys.argv[1]))  # uvloop when installed
