"""The log line of a served gateway is formatted and written off the event loop's thread, and
what was logged is on stderr at exit, or, after kill -9, all but the last few milliseconds."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gateway.core.times import rfc3339
from gateway.observe import logs


def test_lines_are_formatted_and_written_by_the_writer_thread(tmp_path: Path) -> None:
    out = tmp_path / "log"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    formatted_in: list[str] = []

    class Recording(logs.JsonFormatter):
        def format(self, record: logging.LogRecord) -> str:
            formatted_in.append(threading.current_thread().name)
            return super().format(record)

    handler = logs.QueuedHandler(Recording(), fd)
    logger = logging.getLogger("test_logs.writer")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for n in range(200):
            logger.handle(
                logger.makeRecord(logger.name, logging.INFO, "", 0, "call", (), None,
                                  extra={"fields": {"n": n}})
            )  # fmt: skip
        handler.flush()
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [line["n"] for line in lines] == list(range(200))
        assert {line["event"] for line in lines} == {"call"}
        assert set(formatted_in) == {"log-writer"}
    finally:
        logger.removeHandler(handler)
        os.close(fd)


_CHILD = """
import os, signal, sys, time
from gateway.core.times import rfc3339
from gateway.observe import logs
logs.configure("json", "INFO")
for n in range(int(sys.argv[1])):
    logs.event("call", n=n)
if sys.argv[2] == "kill":
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _child(calls: int, end: str) -> tuple[int, list[dict[str, object]]]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(calls), end],
        capture_output=True,
        timeout=60,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    return done.returncode, [json.loads(line) for line in done.stderr.decode().splitlines()]


def test_every_line_is_written_at_exit() -> None:
    code, lines = _child(5000, "exit")
    assert code == 0
    assert [line["n"] for line in lines] == list(range(5000))


def test_kill_9_loses_only_the_last_moments() -> None:
    started = time.monotonic()
    code, lines = _child(2000, "kill")
    assert code == -signal.SIGKILL
    # logged a second before the kill: written by then, however busy the machine was
    assert [line["n"] for line in lines] == list(range(2000)), time.monotonic() - started


_FAILING = """
import sys
from gateway.cli.main import _fail
from gateway.observe import logs
logs.configure("text", "INFO")
logs.event("running_open", 30, detail="logged before the failure")
sys.exit(_fail("cannot start: the reason"))
"""


def test_what_was_logged_before_a_fatal_error_comes_before_its_reason() -> None:
    """A gateway that cannot start says why on its last line of stderr: a warning logged
    earlier, still queued for the log writer thread, is written first, not at exit after it."""
    done = subprocess.run(
        [sys.executable, "-c", _FAILING],
        capture_output=True,
        timeout=60,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = done.stderr.decode().splitlines()
    assert done.returncode == 2
    assert len(lines) == 2 and "running_open" in lines[0], lines
    assert lines[1] == "fence-gateway: cannot start: the reason"


def test_the_line_time_is_the_contract_time_to_the_millisecond() -> None:
    formatter = logs.JsonFormatter()
    edges = [1764600000.0, 1764600000.999, 1764600001.0005, 1764600001.9999996, 1764600001.9995]
    spread = [1_000_000_000 + n * 7_654_321.123457 for n in range(2000)]
    for created in edges + spread + [t + k / 1000 for t in edges for k in range(1000)]:
        assert formatter._stamp(created) == rfc3339(created), created


def test_a_record_made_cheaply_is_the_record_make_record_makes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the logging module's thread and process switches off, as a served gateway sets
    them, `event`'s record is copied from a constant part; a handler reads the same
    attributes off it as off `Logger.makeRecord`'s, the time and the fields its own."""
    for switch in ("logThreads", "logProcesses", "logMultiprocessing", "logAsyncioTasks"):
        monkeypatch.setattr(logging, switch, False, raising=False)
    before = time.time()
    fast = logs._record("call", logging.WARNING, {"n": 1})
    made = logs.log.makeRecord(
        logs.log.name, logging.WARNING, "", 0, "call", (), None, extra={"fields": {"n": 1}}
    )
    timing = {"created", "msecs", "relativeCreated"}
    assert {k: v for k, v in vars(fast).items() if k not in timing} == {
        k: v for k, v in vars(made).items() if k not in timing
    }
    assert before <= fast.created <= time.time()
    assert fast.msecs == int((fast.created - int(fast.created)) * 1000)
    assert abs(fast.relativeCreated - made.relativeCreated) < 1000  # both from the same start
    assert logging.Formatter("%(levelname)s %(name)s:%(lineno)d %(message)s").format(fast) == (
        "WARNING fence_gateway:0 call"
    )


def test_with_thread_details_on_the_record_is_make_records() -> None:
    """Outside a served gateway the switches are on: those details vary, so the record is
    made by `Logger.makeRecord` and carries its own thread's, not the first record's."""
    assert logging.logThreads  # the default
    here = logs._record("call", logging.INFO, {})
    there: list[logging.LogRecord] = []
    other = threading.Thread(target=lambda: there.append(logs._record("call", logging.INFO, {})))
    other.start()
    other.join()
    assert here.thread == threading.get_ident()
    assert there[0].thread == other.ident != here.thread
