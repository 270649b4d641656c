"""Logging set-up: text for people, one JSON object per line for machines (docs/contract.md §10).

Events are logged with `extra={"fields": {...}}`; the JSON formatter puts those fields at the
top level. Nothing here ever sees keys, injected credentials or bodies: callers pass none.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from gateway.core.times import rfc3339

log = logging.getLogger("fence_gateway")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": rfc3339(record.created),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        tail = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        text = f"{stamp} {record.levelname:<7} {record.getMessage()} {tail}".rstrip()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def event(name: str, level: int = logging.INFO, /, **fields: object) -> None:
    """One log line; `name` and `level` are positional only, so every keyword is a field."""
    log.log(level, name, extra={"fields": fields})
