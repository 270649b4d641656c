"""The gateway's HTTP server in this process, as `gateway.server.serve` runs it
(`GatewayRunner`: the front, and aiohttp's protocol behind it), with counts of the requests
each side handled, and raw HTTP/1.1 to talk to it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

from aiohttp import web

from gateway.config.policy_files import load_policies
from gateway.config.settings import Settings
from gateway.server.app import create_app
from gateway.server.http_server import GatewayRunner, GatewayServer
from tests.harness import write_policy


@dataclasses.dataclass
class Served:
    url: str
    port: int
    app: web.Application
    # one element: how many requests were handled (aiohttp's request objects built, and
    # calls the front dispatched): none for a call answered from its head
    requests_made: list[int]
    # of them, those aiohttp handled (a request object built)
    by_aiohttp: list[int]
    server: GatewayServer  # its connections: the fronts, and those handed to aiohttp

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@contextlib.asynccontextmanager
async def served(
    tmp_path: Path, policy: dict[str, Any], max_inflight: str = "auto", **settings_: Any
) -> AsyncIterator[Served]:
    policy_path = write_policy(tmp_path / "policies.yaml", policy)
    settings = Settings(
        _env_file=None,
        database_url=f"sqlite:///{tmp_path}/gw.db",
        policies=str(policy_path),
        instance_id="test-1",
        max_inflight=max_inflight,
        **settings_,
    )
    app = create_app(settings, load_policies(policy_path))
    runner = GatewayRunner(
        app, header_timeout_s=10, handler_cancellation=False, access_log=None
    )  # as gateway.server.serve runs it
    await runner.setup()
    assert runner.server is not None
    made, by_aiohttp = [0], [0]
    build = runner.server.request_factory

    def counting(*args: Any) -> Any:
        made[0] += 1
        by_aiohttp[0] += 1
        return build(*args)

    runner.server.request_factory = counting
    front = cast(GatewayServer, runner.server).front
    dispatch = front.call

    def dispatching(incoming: Any) -> Any:
        made[0] += 1
        return dispatch(incoming)

    front.call = dispatching  # type: ignore[method-assign]
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Served(
            f"http://127.0.0.1:{port}",
            port,
            app,
            made,
            by_aiohttp,
            cast(GatewayServer, runner.server),
        )
    finally:
        await runner.cleanup()


def fenced_post(path: str, body: bytes, resource: str = "job/b", **extra: str) -> bytes:
    """A fenced POST, head and body, as one write."""
    head = [
        f"POST {path} HTTP/1.1",
        "Host: gateway",
        f"X-Lease-Resource: {resource}",
        "X-Fence-Token: 7",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{name.replace('_', '-')}: {value}" for name, value in extra.items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode().rstrip("\r\n").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines)
    headers = {name.lower(): value for name, value in fields.items()}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    return int(status_line.split()[1]), headers, body
