"""Server-sent events (the `text/event-stream` format of the HTML standard), cut into whole
events as bytes arrive, so that an MCP answer streamed as SSE can be relayed event by event
and the event that answers a tool call found before it is passed on (docs/contract.md §16).

An event's raw bytes are kept as they came, to be passed on unchanged; its `data` lines are
joined as the standard says. Lines end with CR LF, LF or CR; an empty line ends an event; one
byte order mark at the start of the stream is not part of its first line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SseEvent:
    raw: bytes  # the event's bytes, its closing empty line included
    event: str | None  # the `event:` field, None when absent
    data: str | None  # the `data:` lines joined by LF; None when there were none


class EventTooLarge(ValueError):
    """An event grew past the splitter's limit before it ended."""


@dataclass(slots=True)
class SseSplitter:
    """Feed it bytes; it returns the events they complete. `max_event_bytes` bounds what is
    held while an event is incomplete."""

    max_event_bytes: int
    _buffer: bytearray = field(default_factory=bytearray)
    _pos: int = 0  # where the next line starts in the buffer
    _event: str | None = None
    _data: list[str] | None = None
    _first_line: bool = True  # the stream's: a BOM before it is not part of it
    _ended: bool = False

    def feed(self, chunk: bytes) -> list[SseEvent]:
        self._buffer += chunk
        events: list[SseEvent] = []
        buffer = self._buffer
        while True:
            end, after = _line_end(buffer, self._pos, self._ended)
            if end < 0:
                break
            line = bytes(buffer[self._pos : end])
            if self._first_line:
                self._first_line = False
                line = line.removeprefix(_BOM)
            self._pos = after
            if line:
                self._field(line)
                continue
            events.append(SseEvent(bytes(buffer[:after]), self._event, self._joined()))
            del buffer[:after]
            self._pos, self._event, self._data = 0, None, None
        if len(buffer) > self.max_event_bytes:
            raise EventTooLarge(f"an event is longer than {self.max_event_bytes} bytes")
        return events

    def end(self) -> list[SseEvent]:
        """The stream ended: the events that completes (a CR it ended with ends a line, as
        no LF can follow it now)."""
        self._ended = True
        return self.feed(b"")

    def rest(self) -> bytes:
        """What was fed after the last whole event (at the end of a stream: a cut event)."""
        return bytes(self._buffer)

    def _field(self, line: bytes) -> None:
        if line.startswith(b":"):
            return  # a comment
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        text = value.decode("utf-8", "replace")
        if name == b"data":
            self._data = [*(self._data or []), text]
        elif name == b"event":
            self._event = text

    def _joined(self) -> str | None:
        return "\n".join(self._data) if self._data is not None else None


_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


def _line_end(buffer: bytearray, start: int, ended: bool) -> tuple[int, int]:
    """(end of the line starting at `start`, start of the next); (-1, -1) while the line is
    incomplete. A CR at the very end waits, unless the stream `ended`: an LF may follow in
    the next chunk."""
    found = _LINE_END.search(buffer, start)
    if found is None or (found.group() == b"\r" and found.end() == len(buffer) and not ended):
        return -1, -1
    return found.start(), found.end()
