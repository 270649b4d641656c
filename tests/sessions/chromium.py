"""Debian's Chromium as a real CDP upstream: started by the test as a subprocess, headless, on
a free debugging port it reports on stderr, with a profile of its own. Never a downloaded
browser. Outside CI a machine without /usr/bin/chromium skips the browser tests with one
line; under CI=true a missing Chromium fails them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
_LISTENING = re.compile(rb"DevTools listening on (ws://[^\s]+)")


def chromium_path() -> str:
    if CHROMIUM.exists():
        return str(CHROMIUM)
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {CHROMIUM} is missing: apt-get install -y chromium")
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium): browser session tests")


def playwright_or_fail() -> None:
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true and playwright is not installed (the test extra has it)")
        pytest.skip("playwright is not installed: pip install playwright (no browser download)")


@dataclass
class Chromium:
    process: subprocess.Popen[bytes]
    ws_url: str  # the browser's own CDP WebSocket, as it announced it

    @property
    def http_url(self) -> str:
        """The debugging endpoint's HTTP address (/json/version and the WebSockets)."""
        return "http://" + self.ws_url.split("/")[2]


@contextlib.asynccontextmanager
async def running_chromium(profile: Path) -> AsyncIterator[Chromium]:
    process = subprocess.Popen(
        [
            chromium_path(),
            "--headless",
            "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1",
            f"--user-data-dir={profile}",
            "--no-sandbox",  # root in CI: no user namespace
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "about:blank",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        ws_url = await asyncio.wait_for(asyncio.to_thread(_announced, process), 20)
        # the rest of its stderr is read and dropped, so a full pipe never blocks it
        threading.Thread(target=_drain, args=(process,), daemon=True).start()
        yield Chromium(process, ws_url)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def _announced(process: subprocess.Popen[bytes]) -> str:
    """The `DevTools listening on ws://…` line of Chromium's stderr."""
    assert process.stderr is not None
    seen = b""
    for line in process.stderr:
        seen += line
        found = _LISTENING.search(line)
        if found:
            return found.group(1).decode()
    raise RuntimeError(
        f"chromium exited without a debugging port:\n{seen.decode(errors='replace')}"
    )


def _drain(process: subprocess.Popen[bytes]) -> None:
    assert process.stderr is not None
    with contextlib.suppress(ValueError, OSError):
        for _ in process.stderr:
            pass
