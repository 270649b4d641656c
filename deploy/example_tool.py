"""A stand-in for a side-effecting tool behind fence-gateway (compose.postgres.yaml runs it).

It answers every request with JSON echoing what the gateway forwarded: method, path and the
X-Fence-Token, X-Lease-Resource and Idempotency-Key headers the gateway sets
(docs/contract.md §3, Forwarded upstream), and logs one line per request on stderr. It acts on
nothing. A real tool can do more with those headers: remember the highest fence per resource
and refuse a lower one, and treat a repeated Idempotency-Key as the same operation.

    python deploy/example_tool.py [--host 127.0.0.1] [--port 9400]

Needs only aiohttp, which the gateway's image already has.
"""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

ECHOED = ("X-Fence-Token", "X-Lease-Resource", "Idempotency-Key")
log = logging.getLogger("example-tool")


async def echo(request: web.Request) -> web.Response:
    await request.read()  # take the body off the connection; it is not echoed
    seen = {"method": request.method, "path": request.path_qs}
    seen.update({name: request.headers.get(name) for name in ECHOED})
    log.info(" ".join(f"{key}={value}" for key, value in seen.items()))
    return web.json_response(seen)


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9400)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s example-tool %(message)s")
    log.info("listening on http://%s:%d", args.host, args.port)
    web.run_app(make_app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
