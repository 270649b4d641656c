"""Fixtures for MCP tests: a real MCP server built with the official SDK (a subprocess, see
`mcp_server.py`) and a gateway in front of it with `mcp: true` (docs/contract.md §16)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import pytest

from tests.harness import REPO_ROOT, GatewayFactory, GatewayProcess, free_port, make_policy

MOUNT = "/mail"


class McpServerProcess:
    """`python -m tests.mcp.mcp_server PORT LOG`: every tool effect and every request it
    received is a JSON line in LOG. Started once for all MCP tests (the SDK takes seconds to
    import); each test sees the lines written since it began (`McpServerView`)."""

    def __init__(self, workdir: Path) -> None:
        self.log = workdir / "mcp-server.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tests.mcp.mcp_server", str(self.port), str(self.log)]

    def start(self) -> Self:
        self.port = free_port()
        self.proc = subprocess.Popen(
            self.command(),
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"the MCP server exited with {self.proc.returncode}")
            time.sleep(0.05)
        raise RuntimeError("the MCP server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    @contextlib.contextmanager
    def serving(self) -> Iterator[Self]:
        """Started, and killed on leaving: a module's own server, for a fixture to yield."""
        self.start()
        try:
            yield self
        finally:
            self.kill()

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


class McpServerView:
    """The shared server as one test sees it: only what was logged since the test began."""

    def __init__(self, server: McpServerProcess) -> None:
        self.server = server
        self.offset = len(server.lines())

    @property
    def url(self) -> str:
        return self.server.url

    def entries(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.server.lines()[self.offset :]]

    def effects(self, tool: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.entries() if "effect" in e and tool in (None, e["effect"])]

    def requests(self) -> list[dict[str, Any]]:
        return [e for e in self.entries() if "request" in e]


@pytest.fixture(scope="session")
def shared_mcp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpServerProcess]:
    server = McpServerProcess(tmp_path_factory.mktemp("mcp-server"))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def mcp_server(shared_mcp_server: McpServerProcess) -> McpServerView:
    """The MCP server, started again when a test before this one crashed it."""
    if not shared_mcp_server.alive():
        shared_mcp_server.start()
    return McpServerView(shared_mcp_server)


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
async def mcp_gateway(gateway_factory: GatewayFactory, mcp_server: McpServerView) -> GatewayProcess:
    return await gateway_factory(mcp_policy(mcp_server.url))
