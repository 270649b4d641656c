"""Logging set-up: text for people, one JSON object per line for machines (docs/contract.md §10).

Events are logged with `extra={"fields": {...}}`; the JSON formatter puts those fields at the
top level. Nothing here ever sees keys, injected credentials or bodies: callers pass none.

A served gateway logs a line for every call, so the event loop only builds the record and
puts it on a queue (`configure`): a thread of its own formats the records and writes what has
queued up with one write system call. The loop never waits on a slow or full stderr, and never
pays for the formatting. The thread writes within about 10 ms of a record's arrival, so the
lines a crash loses are those of its last moments only: at exit (`logging.shutdown`, which
runs at interpreter exit) everything queued is written first; on `kill -9` (or `os._exit`)
the records not yet written, those of the last 10 ms or so, are lost.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import queue
import sys
import threading
import time

from gateway.core.times import rfc3339

log = logging.getLogger("fence_gateway")

_FLUSH_WAIT_S = 5.0  # a stuck stderr (a full pipe nobody reads) never holds an exit longer
# Once a record arrives the writer waits this long for more before it takes the GIL to format
# them: each time it takes the GIL it takes it from the event loop, which on a busy machine
# may not get a core back at once, so lines are formatted in batches, not one by one.
_LINGER_S = 0.01


class JsonFormatter(logging.Formatter):
    # One encoder for every line (json.dumps with an argument makes one per call), and the
    # time's text up to the second made once a second: the two costliest steps of a line.
    _encode = json.JSONEncoder(default=str).encode
    _second: tuple[int, str] = (-1, "")

    def _stamp(self, created: float) -> str:
        """`rfc3339(created)`, rounded as `datetime.fromtimestamp` rounds."""
        fraction, whole = math.modf(created)
        second, micros = int(whole), round(fraction * 1e6)
        if micros >= 1_000_000:
            second, micros = second + 1, micros - 1_000_000
        if second != self._second[0]:
            self._second = (second, (rfc3339(second) or "")[:-4])  # "…T05:07:00."
        return f"{self._second[1]}{micros // 1000:03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self._stamp(record.created),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return self._encode(entry)


def _text_value(value: object) -> str:
    """A field's value on a text line: quoted (with escapes) when it holds a space, a quote,
    `=` or a control character, so that a client's text (a path) can neither end the line
    nor add fields to it."""
    text = str(value)
    if text and not any(c.isspace() or c in '"=' or not c.isprintable() for c in text):
        return text
    return json.dumps(text)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        tail = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items() if v is not None)
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        message = record.getMessage()
        if not message.isprintable():  # a newline in a path, in "unhandled error on ..."
            message = json.dumps(message)[1:-1]
        text = f"{stamp} {record.levelname:<7} {message} {tail}".rstrip()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class QueuedHandler(logging.Handler):
    """Puts records on a queue; a writer thread formats them and writes them to `fd`, as many
    as have queued up in one write."""

    def __init__(self, formatter: logging.Formatter, fd: int) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self._fd = fd
        self._queue: queue.SimpleQueue[logging.LogRecord | threading.Event] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_all, name="log-writer", daemon=True)
        self._writer.start()

    def handle(self, record: logging.LogRecord) -> bool:
        # no handler lock: the queue is thread-safe, and nothing is formatted here
        if self.filter(record):
            self._queue.put(record)
        return True

    def flush(self) -> None:
        """Return once everything logged before has been written (or the wait ran out)."""
        if self._writer.is_alive():
            written = threading.Event()
            self._queue.put(written)
            written.wait(_FLUSH_WAIT_S)

    def _write_all(self) -> None:
        take, more = self._queue.get, self._queue.get_nowait
        while True:
            lines, done = [], []
            item = take()
            if not isinstance(item, threading.Event):  # a flush is not kept waiting
                time.sleep(_LINGER_S)
            while True:
                if isinstance(item, threading.Event):
                    done.append(item)
                else:
                    lines.append(self._line(item))
                try:
                    item = more()
                except queue.Empty:
                    break
            if lines:
                self._write(("\n".join(lines) + "\n").encode("utf-8", "backslashreplace"))
            for event in done:
                event.set()

    def _line(self, record: logging.LogRecord) -> str:
        try:
            return self.format(record)
        except Exception:  # a record that cannot be formatted costs its line, not the log
            return f"unformattable log record {record.msg!r}"

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view) :]
            except InterruptedError:
                continue
            except OSError:
                return  # stderr is gone: there is nobody to tell


def configure(fmt: str, level: str) -> None:
    # The gateway's formatters read none of these: not looking them up saves every record
    # a few calls (the logging module's documented switches for this).
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging.logAsyncioTasks = False  # type: ignore[attr-defined]  # Python 3.12 on
    sys.stderr.flush()
    handler = QueuedHandler(
        JsonFormatter() if fmt == "json" else TextFormatter(), sys.stderr.fileno()
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def flush() -> None:
    """Everything logged so far is written when this returns (before a fatal error's own
    line, and for tests and benchmarks)."""
    for handler in logging.getLogger().handlers:
        handler.flush()


def event(name: str, level: int = logging.INFO, /, **fields: object) -> None:
    """One log line; `name` and `level` are positional only, so every keyword is a field."""
    if log.isEnabledFor(level):
        log.handle(_record(name, level, fields))


def _record(name: str, level: int, fields: dict[str, object]) -> logging.LogRecord:
    """The record `Logger.makeRecord` makes, for a fraction of its cost (a line for every
    call): what does not change between records (no file and line, which no line of the
    gateway shows, so no walk of the stack for them) is copied from one made once, and only
    the message, the time and the fields are set."""
    if (  # details that vary from record to record: Logger.makeRecord looks them up
        logging.logThreads
        or logging.logProcesses
        or logging.logMultiprocessing
        or getattr(logging, "logAsyncioTasks", False)
    ):
        return log.makeRecord(log.name, level, "", 0, name, (), None, extra={"fields": fields})
    record = logging.LogRecord.__new__(logging.LogRecord)
    attributes = record.__dict__
    attributes.update(_constant(level))
    created = time.time()
    attributes["msg"] = name
    attributes["created"] = created
    attributes["msecs"] = int((created - int(created)) * 1000) + 0.0
    attributes["relativeCreated"] = (created - _LOGGING_STARTED_S) * 1000
    attributes["fields"] = fields
    return record


# when the logging module was loaded, which `relativeCreated` counts from (in nanoseconds
# from Python 3.13, in seconds before)
_LOGGING_STARTED_S: float = logging._startTime  # type: ignore[attr-defined]
if isinstance(_LOGGING_STARTED_S, int):
    _LOGGING_STARTED_S /= 1e9


@functools.cache
def _constant(level: int) -> dict[str, object]:
    """What every record of `level` has alike, made once for each level."""
    attributes = log.makeRecord(log.name, level, "", 0, "", (), None).__dict__
    for varying in ("msg", "created", "msecs", "relativeCreated"):
        del attributes[varying]
    return attributes
