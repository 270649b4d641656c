"""The server's life cycle and overload limit at their edges: a drain bounded by the grace
whoever serves the call, workers that start, stop and never outlive their supervisor, and
in-flight slots always given back.

Real processes throughout (`python -m gateway serve`, with and without `--workers`), except
the last test, which drives the overload limit of a real app with the timings uvloop's clock
gives the server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.config.policy_files import load_policies
from gateway.config.settings import Settings
from gateway.server.app import create_app
from gateway.server.overload import LIMIT
from tests.harness import (
    REPO_ROOT,
    Behavior,
    GatewayFactory,
    RecordingUpstream,
    chunked,
    fenced_headers,
    free_port,
    make_policy,
    wait_for,
    write_policy,
)
from tests.pg import create_database, drop_database, url_of


@pytest.fixture
def pg_url() -> Iterator[str]:
    name = create_database()
    yield url_of(name)
    drop_database(name)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_workers(tmp_path: Path, pg_url: str, count: int) -> tuple[subprocess.Popen[bytes], Path]:
    policies = write_policy(
        tmp_path / "policies.yaml", make_policy("http://127.0.0.1:9/api", [{"match": "job/*"}])
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(
        PYTHONPATH=str(REPO_ROOT),
        GATEWAY_POLICIES=str(policies),
        GATEWAY_DATABASE_URL=pg_url,
        GATEWAY_PORT=str(free_port()),
        GATEWAY_WORKERS=str(count),
        GATEWAY_SHUTDOWN_GRACE_S="2",
    )
    log = tmp_path / "supervisor.stderr"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve"],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    return proc, log


def _kill_all(proc: subprocess.Popen[bytes], pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


# --------------------------------------------------------------------------------------------
# Drain at shutdown
# --------------------------------------------------------------------------------------------


async def test_a_call_aiohttp_serves_is_cut_at_the_grace_not_at_twice_the_grace(
    gateway_factory: GatewayFactory, upstream: RecordingUpstream
) -> None:
    """§9: SIGTERM lets calls finish for *up to* GATEWAY_SHUTDOWN_GRACE_S, also a call the front
    hands to aiohttp (here a chunked body): aiohttp's own drain would wait the grace, cancel
    it and wait as long again, past a Kubernetes termination period of twice the grace."""
    upstream.default = Behavior(gate=asyncio.Event())  # the tool never answers
    gateway = await gateway_factory(
        make_policy(upstream.url, [{"match": "job/*"}], timeout_s=60),
        extra_env={"GATEWAY_SHUTDOWN_GRACE_S": "2"},
    )
    assert gateway.proc is not None and gateway.port is not None
    _reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    head = "".join(f"{k}: {v}\r\n" for k, v in fenced_headers("job/a", 1).items())
    writer.write(
        f"POST /tool/x HTTP/1.1\r\nHost: gw\r\n{head}Transfer-Encoding: chunked\r\n\r\n".encode()
        + chunked(b"{}")
    )
    await upstream.wait_received(1)
    started = time.monotonic()
    gateway.proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(gateway.proc.wait, 30)
    took = time.monotonic() - started
    writer.close()
    assert code == 0
    assert took < 2 + 0.8, f"SIGTERM with a 2 s grace took {took:.2f} s to exit"


# --------------------------------------------------------------------------------------------
# serve --workers N
# --------------------------------------------------------------------------------------------


async def test_sigterm_while_the_workers_start_exits_0(tmp_path: Path, pg_url: str) -> None:
    """SIGTERM to the supervisor while its workers are still starting (a deploy rolled back at
    once, or a worker being restarted): the workers start with SIGTERM held as SIGHUP is, and
    drain once they can, so they exit 0 and so does the supervisor (a worker killed by the
    signal, -15, would make it exit 1)."""
    proc, log = _start_workers(tmp_path, pg_url, 2)
    try:
        await wait_for(lambda: b"workers_started" in log.read_bytes(), timeout=15)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
        assert code == 0, log.read_text()
    finally:
        _kill_all(proc, set())


async def test_sigterm_while_the_supervisor_spawns_stops_every_worker(
    tmp_path: Path, pg_url: str
) -> None:
    """SIGTERM handled while a worker is being spawned (at start, or at a restart): the worker
    being spawned joins the list after the signal was passed on, and is told too, or the
    supervisor would wait for it for ever (a worker left serving). The supervisor is
    stopped (SIGSTOP) in that window so that the timing is certain."""
    count = 4
    for _attempt in range(3):
        proc, _log = _start_workers(tmp_path, pg_url, count)
        pids: set[int] = set()
        try:
            deadline = time.monotonic() + 15
            while not _children(proc.pid):
                assert time.monotonic() < deadline and proc.poll() is None
            proc.send_signal(signal.SIGSTOP)
            spawned = _children(proc.pid)
            if len(spawned) >= count:  # too late to be in the window: again
                continue
            proc.send_signal(signal.SIGTERM)  # pending until it runs again
            proc.send_signal(signal.SIGCONT)
            try:
                await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                pids = set(_children(proc.pid))
                pytest.fail(
                    f"the supervisor did not exit within 20 s of SIGTERM; "
                    f"workers still running: {sorted(p for p in pids if _alive(p))}"
                )
            return
        finally:
            pids |= set(_children(proc.pid))
            _kill_all(proc, pids)
    pytest.skip("could not stop the supervisor while it was spawning its workers")


async def test_workers_do_not_outlive_a_killed_supervisor(tmp_path: Path, pg_url: str) -> None:
    """The supervisor killed (kill -9, the OOM killer): its workers drain and exit, instead of
    serving on the port (SO_REUSEPORT) with nobody to pass them SIGTERM or SIGHUP, beside a
    new `serve --workers` started on it."""
    proc, log = _start_workers(tmp_path, pg_url, 2)
    workers: set[int] = set()
    try:
        await wait_for(lambda: log.read_text().count("serving") >= 2, timeout=20)
        workers = set(_children(proc.pid))
        assert len(workers) == 2
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 8
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        left = sorted(pid for pid in workers if _alive(pid))
        assert left == [], f"workers {left} still running after their supervisor was killed"
    finally:
        _kill_all(proc, workers)


# --------------------------------------------------------------------------------------------
# GATEWAY_MAX_INFLIGHT=auto
# --------------------------------------------------------------------------------------------


def test_calls_answered_within_one_tick_of_uvloop_s_clock_give_back_their_slots(
    tmp_path: Path,
) -> None:
    """The server times a counted call with `loop.time()`; on uvloop (the `speed` extra, which
    `serve` runs on when installed) that clock moves in whole milliseconds, so a call answered
    within the millisecond its head came in (a 404, a refusal at the edge) measures exactly
    0.0 s. A window of such calls has a mean of 0.0, which the adaptive limit must not divide
    by, and each call gives its slot back whatever the limit's sample did; a slot leaked per
    call would climb to the limit and shed every proxied call 503 overloaded for good. (The
    calls here measure 0.0 as on uvloop, whichever loop runs the test.)"""
    policy_path = write_policy(
        tmp_path / "policies.yaml", make_policy("http://127.0.0.1:9/api", [{"match": "job/*"}])
    )
    app = create_app(
        Settings(
            _env_file=None,
            database_url=f"sqlite:///{tmp_path}/gw.db",
            policies=str(policy_path),
            instance_id="t",
        ),
        load_policies(policy_path),
    )
    limit = app[LIMIT]
    assert limit.adaptive
    headers = CIMultiDictProxy(CIMultiDict({"Host": "gw"}))
    errors: list[BaseException] = []
    for n in range(30):  # 30 calls over 0.3 s: windows of 10 calls and 0.1 s
        now = 1000.0 + n * 0.011  # one tick of uvloop's clock holds both ends of each call
        assert limit.admit("GET", "/nowhere", "/nowhere", headers, now) is True
        try:
            limit.done(0.0, now)
        except Exception as exc:  # raised out of the server's `finally`
            errors.append(exc)
    assert limit.in_flight == 0, f"{limit.in_flight} slots never given back: {errors[:1]!r}"
