"""The benchmark's tool: answers every request at once with 200 and a small JSON body.

It runs in its own process (`python -m tests.bench.upstream`) so that the load generator, the
gateway and the tool each have their own event loop, as they would in production; sharing the
bench's loop would make the direct baseline look slower than the tool really is. It binds an
ephemeral port on 127.0.0.1 and prints it on stdout, so there is no race for a free port.
It runs on uvloop when installed, so that it is rarely what limits a row.
"""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web

from gateway.server import eventloop

BODY = b'{"ok": true}'


async def _answer(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=BODY, content_type="application/json")


async def main() -> None:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", _answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await runner.cleanup()


if __name__ == "__main__":
    eventloop.run(main())  # on uvloop when installed, as the peer
