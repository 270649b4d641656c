"""The store's own faults: the disk fills up, or the database's files turn read-only, under a
running gateway.

docs/contract.md §3 step 6 (a store that cannot commit: `503 store_unavailable`, nothing
forwarded; the gateway fails closed), §3 "Outcome" (an outcome write that fails: the answer is
passed on with `X-Receipt-Outcome: unrecorded`, the receipt stays `pending`), §10 (`readyz`
is 503 while the store does not accept writes) and §9 (recovery). When the fault is gone the
same process serves again, without a restart, and nothing it acknowledged is lost, not even
across a `kill -9` afterwards.

Real faults only: the database lives on a tmpfs of 2 MiB mounted for the test and filled with
a file until the kernel says ENOSPC; or on a small ext4 file system, where its files get the
immutable attribute (`chattr +i`, which ext4 enforces on descriptors already open, where a
mode change would not, least of all for root). Both need root: elsewhere the tests skip with
one line, on CI they fail.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.harness import (
    Behavior,
    CallResult,
    GatewayFactory,
    GatewayProcess,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    make_policy,
    problem,
    problem_summary,
)

RESOURCE = "disk/r1"
NEEDS_ROOT = "store fault tests need root: they mount small file systems and set chattr +i"


@pytest.fixture
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A small file system for the database, unmounted at teardown (after the gateway is
    killed: fixtures are torn down in reverse order, and tests request this one first).

    For a full disk, a 2 MiB tmpfs. For read-only files, a 4 MiB ext4 image on a loop device:
    ext4 enforces the immutable attribute on descriptors already open; tmpfs does not."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(NEEDS_ROOT)
        pytest.skip(NEEDS_ROOT)
    mount = tmp_path / "small-fs"
    mount.mkdir()
    if request.param == "disk full":
        source = ["-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs"]
    else:
        image = tmp_path / "small-fs.img"
        with open(image, "wb") as out:
            out.truncate(4 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        source = ["-o", "loop", str(image)]
    subprocess.run(["mount", *source, str(mount)], check=True)
    try:
        yield mount
    finally:
        immutable(mount, False)
        subprocess.run(["umount", "-l", str(mount)], check=False)


def immutable(folder: Path, on: bool) -> None:
    """Set or clear the immutable attribute of the database's files in `folder`: the database
    and its write-ahead log. Not the `-shm` index, which SQLite writes through a shared memory
    mapping: a write fault there is a SIGBUS that kills the process (failing closed, but
    with no word said), which is not this test's subject."""
    files = [str(path) for path in folder.iterdir() if path.is_file() and path.suffix != ".db-shm"]
    if files:
        subprocess.run(["chattr", "+i" if on else "-i", *files], check=True)


def fill(folder: Path) -> Path:
    """Fill the file system of `folder` to the last byte; the filler's path."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as out:
        for size in (1 << 16, 1 << 12, 1):
            try:
                while out.write(b"\0" * size):
                    pass
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    return filler


class Fault:
    """A fault of the database's file system: `start` breaks it, `end` repairs it."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name, self.folder = name, folder
        self._filler: Path | None = None

    def start(self) -> None:
        if self.name == "disk full":
            self._filler = fill(self.folder)
        else:
            immutable(self.folder, True)

    def end(self) -> None:
        if self.name == "disk full":
            assert self._filler is not None
            self._filler.unlink()
        else:
            immutable(self.folder, False)


async def fenced(session: aiohttp.ClientSession, gateway: GatewayProcess, n: int) -> CallResult:
    return await call(
        session,
        "POST",
        f"{gateway.url}/tool/op/{n}",
        label=n,
        data=f'{{"n": {n}}}'.encode(),
        headers=fenced_headers(RESOURCE, 1, **{"Idempotency-Key": f"op-{n}"}),
    )


async def ready(session: aiohttp.ClientSession, gateway: GatewayProcess) -> int | None:
    result = await call(session, "GET", f"{gateway.url}/_gateway/readyz")
    return result.status


async def ready_gauge(session: aiohttp.ClientSession, gateway: GatewayProcess) -> str | None:
    """`fence_gateway_ready` as the metrics page shows it (the alerting rules read it)."""
    result = await call(session, "GET", f"{gateway.url}/_gateway/metrics")
    found = re.search(rb"^fence_gateway_ready (\S+)$", result.body, flags=re.MULTILINE)
    return found.group(1).decode() if found else None


async def eventually(
    probe: Callable[[], Any], expected: Any, *, timeout: float = 5.0, what: str = ""
) -> None:
    """Poll the coroutine function `probe` until it returns `expected`."""
    deadline = time.monotonic() + timeout
    while (got := await probe()) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still {got!r} after {timeout}s, not {expected!r}")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("small_fs", ["disk full", "read-only files"], indirect=True)
async def test_a_store_fault_fails_closed_and_heals_without_a_restart(
    request: pytest.FixtureRequest,
    small_fs: Path,
    upstream: RecordingUpstream,
    gateway_factory: GatewayFactory,
    session: aiohttp.ClientSession,
) -> None:
    gateway = await gateway_factory(
        make_policy(
            upstream.url,
            [{"match": "disk/**"}, {"match": "lease/**", "lease": {"issuer": "gateway"}}],
            timeout_s=10,
        ),
        extra_env={"GATEWAY_DATABASE_URL": f"sqlite:///{small_fs / 'gw.db'}"},
        sweep_interval_s=0.1,
    )
    fault = Fault(request.node.callspec.params["small_fs"], small_fs)

    # Acknowledged before the fault: each answered by the tool, its outcome recorded.
    before = [await fenced(session, gateway, n) for n in range(5)]
    assert [(r.status, r.headers and r.headers.get("X-Receipt-Outcome")) for r in before] == [
        (200, None)
    ] * 5

    # One call is in flight at the tool while the fault starts: admitted, forwarded, waiting.
    answer_now = asyncio.Event()
    upstream.script("/api/op/slow", Behavior(gate=answer_now))
    slow = asyncio.create_task(
        call(
            session,
            "POST",
            f"{gateway.url}/tool/op/slow",
            data=b"{}",
            headers=fenced_headers(RESOURCE, 1, **{"Idempotency-Key": "op-slow"}),
        )
    )
    await upstream.wait_received(1, path="/api/op/slow")

    fault.start()
    try:
        await eventually(lambda: ready(session, gateway), 503, what="readyz during the fault")
        await eventually(lambda: ready_gauge(session, gateway), "0.0", what="the ready gauge")
        # §3 step 6: the store cannot commit, so the call is refused and never forwarded.
        refused = [await fenced(session, gateway, n) for n in range(100, 105)]
        assert [(r.status, problem(r)["code"]) for r in refused] == [(503, "store_unavailable")] * 5
        # The lease API fails closed too; a refusal that needs no store is still answered
        # (its rejected receipt cannot be kept), and nothing is a 500.
        acquire = await call(
            session, "POST", f"{gateway.url}/_gateway/v1/leases/lease/a", json={"owner": "w"}
        )
        bad_fence = await call(
            session,
            "POST",
            f"{gateway.url}/tool/op/bad",
            data=b"{}",
            headers=fenced_headers(RESOURCE, "01"),
        )
        assert [problem_summary(r) for r in (acquire, bad_fence)] == [
            (503, "store_unavailable"),
            (400, "invalid_fence"),
        ]
        # The call in flight gets its answer, but its outcome could not be written (§3).
        answer_now.set()
        unrecorded = await asyncio.wait_for(slow, 10)
        assert unrecorded.status == 200 and unrecorded.headers is not None
        assert unrecorded.headers.get("X-Receipt-Outcome") == "unrecorded"
        assert await ready(session, gateway) == 503
    finally:
        fault.end()

    # The same process recovers by itself.
    await eventually(lambda: ready(session, gateway), 200, what="readyz after the fault")
    await eventually(lambda: ready_gauge(session, gateway), "1.0", what="the ready gauge after")
    taken = await call(
        session, "POST", f"{gateway.url}/_gateway/v1/leases/lease/a", json={"owner": "w"}
    )
    assert (taken.status, taken.json()["fence"]) == (201, 1)
    after = [await fenced(session, gateway, n) for n in range(200, 203)]
    assert [(r.status, r.headers and r.headers.get("X-Receipt-Outcome")) for r in after] == [
        (200, None)
    ] * 3
    forwarded = [r.path for r in upstream.requests]
    assert forwarded == [
        *(f"/api/op/{n}" for n in range(5)),
        "/api/op/slow",
        *(f"/api/op/{n}" for n in range(200, 203)),
    ], "a refused call reached the tool"

    # Nothing acknowledged is lost, not even across a crash: kill -9 and start again.
    acknowledged = {r.headers["X-Receipt-Id"] for r in before + after if r.headers}
    await gateway.kill9()
    await gateway.restart()
    receipts = {r["id"]: r for r in await fetch_receipts(session, gateway.url)}
    assert {receipts[i]["status"] for i in acknowledged} == {"succeeded"}
    # The unrecorded one stayed `pending`, so recovery made it `outcome_unknown`.
    assert unrecorded.headers is not None
    assert receipts[unrecorded.headers["X-Receipt-Id"]]["status"] == "outcome_unknown"
    # The calls refused during the fault left no receipt: their admission never committed.
    assert [r["path"] for r in receipts.values() if r["path"].startswith("/op/10")] == []
    assert "Traceback" not in gateway.stderr_text()
