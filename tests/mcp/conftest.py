"""Fixtures for MCP tests: a real MCP server built with the official SDK (a subprocess, see
`mcp_server.py`) and a gateway in front of it with `mcp: true` (docs/contract.md §16)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO_ROOT, GatewayFactory, GatewayProcess, free_port, make_policy

MOUNT = "/mail"


class McpServerProcess:
    """`python -m tests.mcp.mcp_server PORT LOG`: every tool effect and every request it
    received is a JSON line in LOG."""

    def __init__(self, workdir: Path) -> None:
        self.log = workdir / "mcp-server.log"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> McpServerProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.mcp.mcp_server", str(self.port), str(self.log)],
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"the MCP server exited with {self.proc.returncode}")
            await asyncio.sleep(0.05)
        raise RuntimeError("the MCP server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def entries(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def effects(self, tool: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.entries() if "effect" in e and tool in (None, e["effect"])]

    def requests(self) -> list[dict[str, Any]]:
        return [e for e in self.entries() if "request" in e]


@pytest.fixture
async def mcp_server(tmp_path: Path) -> AsyncIterator[McpServerProcess]:
    server = McpServerProcess(tmp_path)
    await server.start()
    try:
        yield server
    finally:
        server.kill()


def mcp_policy(url: str, **upstream: Any) -> dict[str, Any]:
    """The MCP server at /mail: `send_*`, `deploy` and `crash_midway` are fenced on `mail/*`
    with leases the gateway issues; `lookup` is not fenced."""
    return make_policy(
        url,
        [
            {
                "match": "mail/*",
                "tools": ["send_*", "deploy", "crash_midway"],
                "lease": {"issuer": "gateway", "ttl_s": 30, "max_ttl_s": 60},
            }
        ],
        name="mail",
        mount=MOUNT,
        mcp=True,
        **upstream,
    )


@pytest.fixture
async def mcp_gateway(
    gateway_factory: GatewayFactory, mcp_server: McpServerProcess
) -> GatewayProcess:
    return await gateway_factory(mcp_policy(mcp_server.url))
