"""Running wrk and reading its report (tests/bench/lua/report.lua prints one line of it)."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from pathlib import Path

LUA = Path(__file__).parent / "lua"


@dataclass(slots=True)
class Result:
    requests: int
    seconds: float
    errors: int  # socket errors and non-2xx/3xx answers together
    non_2xx: int
    p50_ms: float
    p99_ms: float
    mean_ms: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


async def run(
    url: str,
    *,
    connections: int,
    seconds: float,
    script: str = "get.lua",
    args: tuple[str, ...] = (),
    timeout_s: float = 30,
) -> Result:
    """`wrk -t1 -cN -dS` with a script from tests/bench/lua and its arguments."""
    command = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        f"--timeout={timeout_s:g}s",
        "-s",
        str(LUA / script),
        url,
    ]
    if args:
        command += ["--", *args]
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "BENCH_LUA": str(LUA)},
    )
    assert proc.stdout is not None and proc.stderr is not None
    lines = []
    async for raw in proc.stdout:
        line = raw.decode()
        lines.append(line)
        if line.startswith("WRK_LIMIT"):
            # fenced.lua answered its LIMIT: wrk's main thread sleeps out -d regardless, and
            # SIGINT is how wrk is told to stop early and still report
            proc.send_signal(signal.SIGINT)
    err = await proc.stderr.read()
    await proc.wait()
    for line in lines:
        if line.startswith("WRK_RESULT "):
            requests, micros, connect, read, write, status, timeout, p50, p99, mean = (
                float(x) for x in line.split()[1:]
            )
            return Result(
                int(requests),
                micros / 1e6,
                int(connect + read + write + status + timeout),
                int(status),
                p50 / 1000,
                p99 / 1000,
                mean / 1000,
            )
    raise RuntimeError(f"wrk gave no report: {''.join(lines)} {err.decode()}")
