"""What both demos (`fence-gateway demo`, `demo --browser`) stage and how they tell it.

A real gateway runs as a subprocess (`python -m gateway serve`) on a free port with a
throwaway SQLite database and policy, so a demo exercises exactly what `serve` runs; the
tools it fronts are small aiohttp apps served on this machine. The race is told on a timeline,
and when a demo cannot be staged the last lines of the gateway's log say why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.client import GatewayClient, Lease

READY_TIMEOUT_S = 10.0
# Worker B's own lease, once A's has expired: long enough that an acquire retried on a loaded
# machine (a retried attempt's lease dates from its first send) leaves B time to act.
TAKEOVER_TTL_S = 10

Out = Callable[[str], Any]


class DemoFailed(Exception):
    """The demo could not be staged (gateway did not start); the message says why."""


class Timeline:
    """Prints lines stamped with the time since the race began."""

    def __init__(self, out: Out) -> None:
        self._out, self._start = out, time.monotonic()

    def __call__(self, who: str, what: str) -> None:
        self._out(f"  t+{time.monotonic() - self._start:5.2f}s  {who:<2} {what}")


def takeover(gw: GatewayClient, resource: str) -> Lease:
    """Worker B's lease on `resource`, waiting politely (up to 8 s) for A's to expire."""
    return gw.lease(resource, owner="worker-b", ttl_s=TAKEOVER_TTL_S, acquire_timeout_s=8)


def short(receipt_id: str) -> str:
    return "…" + receipt_id[-8:] if len(receipt_id) > 9 else receipt_id


async def serve_locally(app: web.Application) -> tuple[web.AppRunner, str]:
    """`app` on a free port of 127.0.0.1: its runner (to clean up) and its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


class DemoGateway:
    """The gateway under demonstration, its files (policy, database, log) in `tmp`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.log = tmp / "gateway.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""

    async def start(self, policy: str, sweep_interval_s: float = 0.2) -> str:
        """Start it with `policy` (YAML); its base URL. It serves once `wait_ready` returns."""
        policy_path = self.tmp / "policy.yaml"
        policy_path.write_text(policy)
        port = _free_port()
        with self.log.open("wb") as log_file:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gateway",
                "serve",
                cwd=self.tmp,
                env=_env(self.tmp, port, policy_path, sweep_interval_s),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
            )
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        assert self.proc is not None
        give_up = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < give_up:
            if self.proc.returncode is not None:
                raise DemoFailed(f"the gateway exited with status {self.proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(
                    f"{self.url}/_gateway/readyz", timeout=aiohttp.ClientTimeout(total=1)
                ) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
        raise DemoFailed(f"the gateway was not ready within {READY_TIMEOUT_S:g} s")

    async def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()

    def failed(self, exc: Exception, out: Out) -> int:
        """Say why the demo failed, with the end of the gateway's log; exit status 1."""
        out(f"\ndemo failed: {exc}")
        if tail := self._log_tail():
            out(f"gateway log (last lines):\n{tail}")
        return 1

    def _log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(tmp: Path, port: int, policy: Path, sweep_interval_s: float) -> dict[str, str]:
    """The caller's environment without its GATEWAY_* settings (a clients file, a database
    URL), plus the demo's own; the folder that holds the `gateway` package goes first on
    PYTHONPATH so an uninstalled checkout works too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    root = str(Path(__file__).resolve().parents[2])  # gateway/cli/ → the checkout
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(
        GATEWAY_HOST="127.0.0.1",
        GATEWAY_PORT=str(port),
        GATEWAY_DATABASE_URL=f"sqlite:///{tmp / 'demo.db'}",
        GATEWAY_POLICIES=str(policy),
        GATEWAY_SWEEP_INTERVAL_S=f"{sweep_interval_s:g}",
        GATEWAY_LOG_LEVEL="WARNING",
    )
    return env
