"""Counting the gateway's fsyncs, to show how many calls share one group commit; what one
fdatasync costs on the databases' filesystem (`fdatasync_ms`); and what one store operation
costs there, its COMMIT included (`store_operation_ms`).

The gateway keeps its batch counter to itself, so the bench counts what a batch costs the disk
instead: `fsync`/`fdatasync` system calls of the gateway process, read from the kernel's
syscall tracepoints by `perf stat -p PID`. Unlike strace this does not stop the process on
every call, so the batching it measures is the batching that happens without it. In strict
mode each SQLite commit is one `fdatasync` of the WAL (checkpoints add a few), so calls per
fsync is calls per batch. Where perf is missing or not allowed, the counts are None.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

EVENTS = "syscalls:sys_enter_fsync,syscalls:sys_enter_fdatasync"


def available() -> bool:
    """perf is installed and may read syscall tracepoints (root, or a permissive kernel)."""
    if shutil.which("perf") is None:
        return False
    probe = subprocess.run(
        ["perf", "stat", "-x,", "-e", EVENTS, "--", "true"], capture_output=True, check=False
    )
    return probe.returncode == 0


class Count:
    value: int | None = None


@contextlib.asynccontextmanager
async def counting(pid: int, enabled: bool) -> AsyncIterator[Count]:
    """Count the fsyncs of `pid` while the block runs; `Count.value` is set on exit."""
    count = Count()
    if not enabled:
        yield count
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "perf.csv"
        perf = await asyncio.create_subprocess_exec(
            "perf",
            "stat",
            "-x,",
            "-o",
            str(out),
            "-e",
            EVENTS,
            "-p",
            str(pid),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(100):  # perf writes its header once the counters are attached
            if out.exists() and out.stat().st_size:
                break
            await asyncio.sleep(0.01)
        try:
            yield count
        finally:
            perf.send_signal(signal.SIGINT)
            await perf.wait()
        count.value = _parse(out.read_text())


def _parse(text: str) -> int | None:
    total, seen = 0, False
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2].startswith("syscalls:") and fields[0].isdigit():
            total += int(fields[0])
            seen = True
    return total if seen else None


def fdatasync_ms(directory: Path, count: int = 200) -> tuple[float, float]:
    """The median and the 99th percentile (ms) of `fdatasync` after a 4 KiB write, on the
    filesystem of `directory` (where the bench's databases are): what a commit waits on at
    the least, measured in the same run as the rows it explains."""
    path = directory / "fdatasync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    times = []
    try:
        block = b"\0" * 4096
        for n in range(count):
            os.pwrite(fd, block, (n % 16) * 4096)
            started = time.perf_counter()
            os.fdatasync(fd)
            times.append((time.perf_counter() - started) * 1000)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(times), statistics.quantiles(times, n=100)[98]


async def store_operation_ms(
    directory: Path, count: int = 200, warm_up: int = 1000
) -> tuple[float, float]:
    """The medians (ms) of an admission and of an outcome on the gateway's own SQLite store
    (strict) in `directory`, one call at a time as at one connection: each its statements and
    its COMMIT, on the event loop's thread as a batch that is all the work there is. A COMMIT
    writes a WAL frame for every page it changed (two `pwrite`s each) and takes and lets go of
    the WAL's locks before its fdatasync: set beside `fdatasync_ms`, it shows what the
    one-connection target's allowance of two fdatasyncs leaves out. The first `warm_up` calls
    are not timed: until the WAL is first checkpointed and starts again from its beginning,
    every commit makes the file longer, and its fdatasync writes the file's new size too."""
    from gateway.core.outcomes import Outcome
    from gateway.store.base import Admitted
    from gateway.store.sqlite import SqliteStore
    from tests.bench.growth import store_call

    store = SqliteStore(
        directory / "store-probe.db", instance="bench", durability="strict", active_calls=lambda: 1
    )
    await store.open()
    admissions: list[float] = []
    outcomes: list[float] = []
    outcome = Outcome(  # as the bench's tool answers, kept for replay
        "succeeded",
        http_status=200,
        forwarded_at=time.time(),
        response=([("Content-Type", "application/json")], b'{"ok": true}'),
    )
    try:
        for n in range(warm_up + count):
            started = time.perf_counter()
            admitted = await store.admit(store_call("bench/probe", f"probe-{n}"))
            admitted_at = time.perf_counter()
            assert isinstance(admitted, Admitted), admitted
            await store.complete(admitted.receipt_id, outcome)
            if n >= warm_up:
                admissions.append((admitted_at - started) * 1000)
                outcomes.append((time.perf_counter() - admitted_at) * 1000)
    finally:
        await store.close()
        for path in directory.glob("store-probe.db*"):
            path.unlink()
    return statistics.median(admissions), statistics.median(outcomes)
