"""Receipt ids: 26-character ULIDs that sort in the order they were made.

Within one millisecond the random part is incremented instead of redrawn, so ids made by one
writer are strictly increasing, which is what cursor pagination relies on.
"""

from __future__ import annotations

import os
import random
import time

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32
_PAIRS = [a + b for a in _ALPHABET for b in _ALPHABET]  # two digits for each 10-bit value
_SHIFTS = range(120, -1, -10)  # 13 pairs: 130 bits, the top two always 0
# Ids must be unique and ordered, not secret (a receipt id grants nothing): the Mersenne
# Twister, seeded from the OS, instead of a system call for every new millisecond.
_random = random.Random()
# A forked child would otherwise draw the parent's sequence and mint the parent's ids.
os.register_at_fork(after_in_child=_random.seed)


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
            if random >> 80:  # the millisecond's 80 bits are used up: go on in the next one
                ms, random = ms + 1, 0
        else:
            random = _random.getrandbits(79)  # leaves room to count up within a millisecond
        self._last_ms, self._last_random = ms, random
        return _encode_id(ms, random)


def id_floor(ts: float) -> str:
    """The lowest id a writer can make at `ts` or later: a lower bound for ids by time."""
    return _encode(_millisecond(ts) << 80)


def id_ceiling(ts: float) -> str:
    """The lowest id of the millisecond after `ts`'s: above every id made before `ts` (but
    for ids that ran ahead of a clock set back)."""
    return _encode((_millisecond(ts) + 1) << 80)


def _millisecond(ts: float) -> int:
    """The millisecond an id made at `ts` begins with (none before the epoch)."""
    return max(int(ts * 1000), 0)


def _encode(value: int) -> str:
    """26 Crockford digits of a 128-bit value, two at a time."""
    return "".join([_PAIRS[(value >> shift) & 1023] for shift in _SHIFTS])


def _encode_id(ms: int, random: int) -> str:
    """`_encode((ms << 80) | random)` for `random` below 2**80 (it is drawn below 2**79 and
    only counts up by one), without the 130-bit number: its pairs of digits from the
    millisecond and the two 40-bit halves of the random part, smaller numbers, which take
    fewer steps to shift and mask."""
    p, high, low = _PAIRS, random >> 40, random & 0xFF_FFFF_FFFF
    return "".join(
        (
            p[(ms >> 40) & 1023],
            p[(ms >> 30) & 1023],
            p[(ms >> 20) & 1023],
            p[(ms >> 10) & 1023],
            p[ms & 1023],
            p[high >> 30],
            p[(high >> 20) & 1023],
            p[(high >> 10) & 1023],
            p[high & 1023],
            p[low >> 30],
            p[(low >> 20) & 1023],
            p[(low >> 10) & 1023],
            p[low & 1023],
        )
    )


def _decode(text: str) -> int:
    value = 0
    for char in text:
        value = value * 32 + _ALPHABET.index(char)
    return value
