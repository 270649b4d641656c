"""`serve --workers N`: N gateway processes on one port, each a replica of the shared store
(docs/contract.md §14).

Each worker is this program's own `serve`, started with `--worker`: it binds the port with
SO_REUSEPORT, so the kernel spreads new connections over the workers. This process only
supervises: it passes SIGTERM and SIGINT on and waits for every worker to drain; it passes
SIGHUP on, so that every worker reads its TLS certificate again (docs/contract.md §22), and
starts each worker with SIGHUP blocked, so that one sent before the worker can reload waits
for it instead of killing it (`serve` unblocks it once its handler is in place); it restarts
a worker that dies on its own (at most once a second each), since its peers recover the dead
one's calls like any replica's; and when a worker exits with a configuration error (status
2), every worker would, so it stops them all and exits 2.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from gateway.config.settings import Settings
from gateway.observe import logs

EXIT_CONFIG = 2
RESTART_PAUSE_S = 1.0
_POLL_S = 0.1
# Held in a worker until `serve` has its handlers in place (it unblocks them): one sent
# while it starts is handled then, instead of killing it.
HELD_SIGNALS = frozenset({signal.SIGHUP, signal.SIGTERM, signal.SIGINT})
# The supervisor's pid, in each worker's environment: a worker whose parent is no longer it
# (killed, kill -9) drains and exits instead of serving on unsupervised.
SUPERVISOR_ENV = "FENCE_GATEWAY_SUPERVISOR_PID"


class WorkersError(Exception):
    """Settings that cannot run several workers: exit status 2."""


def check_workers(settings: Settings) -> None:
    if settings.workers == 1:
        return
    if settings.database_url.startswith("sqlite:///"):
        raise WorkersError(
            f"GATEWAY_WORKERS={settings.workers} needs a store that several processes share: "
            "SQLite is one process per database file; set GATEWAY_DATABASE_URL=postgresql://…"
        )
    if settings.port == 0:
        raise WorkersError(
            "GATEWAY_WORKERS above 1 needs a fixed GATEWAY_PORT: the workers share one port"
        )


def worker_command() -> list[str]:
    """How this program starts one worker: the same interpreter, `serve --worker`."""
    return [sys.executable, "-m", "gateway", "serve", "--worker"]


def supervise(settings: Settings) -> int:
    """Run `settings.workers` workers until SIGTERM or SIGINT; the exit status."""
    stopping: list[int] = []  # the signal received, once one is
    workers: list[subprocess.Popen[bytes]] = []
    told: set[int] = set()  # the workers the stopping signal was passed to

    def pass_on(signum: int) -> None:
        for worker in workers:
            if worker.pid not in told and worker.poll() is None:
                told.add(worker.pid)
                worker.send_signal(signum)

    def stop(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)
        pass_on(signum)

    def hangup(signum: int, _frame: FrameType | None) -> None:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, hangup)
    started = [time.monotonic()] * settings.workers
    workers.extend(_spawn() for _ in range(settings.workers))
    logs.event("workers_started", count=settings.workers, pids=[w.pid for w in workers])
    while True:
        if stopping:
            pass_on(stopping[-1])  # to one spawned while the signal was being handled
            if all(worker.poll() is not None for worker in workers):
                codes = [worker.returncode for worker in workers]
                logs.event("workers_stopped", codes=codes)
                return 0 if all(code == 0 for code in codes) else 1
        else:
            for index, worker in enumerate(workers):
                code = worker.poll()
                if code is None:
                    continue
                if code == EXIT_CONFIG:
                    stop(signal.SIGTERM, None)
                    _wait_all(workers)
                    return EXIT_CONFIG
                if time.monotonic() - started[index] < RESTART_PAUSE_S:
                    continue  # not yet: a worker that dies at once must not spin
                logs.event("worker_restarted", logging.ERROR, pid=worker.pid, code=code)
                workers[index] = _spawn()
                started[index] = time.monotonic()
        time.sleep(_POLL_S)


def _spawn() -> subprocess.Popen[bytes]:
    """One worker, with HELD_SIGNALS blocked: a child inherits the mask across exec."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        return subprocess.Popen(
            worker_command(), env={**os.environ, SUPERVISOR_ENV: str(os.getpid())}
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _wait_all(workers: list[subprocess.Popen[bytes]]) -> None:
    for worker in workers:
        worker.wait()
