"""Receipt ids: 26-character ULIDs that sort in the order they were made.

Within one millisecond the random part is incremented instead of redrawn, so ids made by one
writer are strictly increasing, which is what cursor pagination relies on.
"""

from __future__ import annotations

import secrets
import time

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32


class MonotonicUlid:
    def __init__(self) -> None:
        self._last_ms = 0
        self._last_random = 0

    def continue_after(self, last_id: str) -> None:
        """Make every later id sort after `last_id`, even if the clock went back."""
        value = _decode(last_id)
        self._last_ms, self._last_random = value >> 80, value & ((1 << 80) - 1)

    def __call__(self, now: float | None = None) -> str:
        ms = int((time.time() if now is None else now) * 1000)
        if ms <= self._last_ms:
            ms, random = self._last_ms, self._last_random + 1
        else:
            random = secrets.randbits(79)  # leaves room to count up within a millisecond
        self._last_ms, self._last_random = ms, random
        return _encode((ms << 80) | random)


def id_floor(ts: float) -> str:
    """The lowest id a writer can make at `ts` or later: a lower bound for ids by time."""
    return _encode(max(int(ts * 1000), 0) << 80)


def _encode(value: int) -> str:
    chars = []
    for _ in range(26):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def _decode(text: str) -> int:
    value = 0
    for char in text:
        value = value * 32 + _ALPHABET.index(char)
    return value
