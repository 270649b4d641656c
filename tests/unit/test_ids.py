"""Receipt ids (gateway.store.ids): Crockford base32 ULIDs, strictly increasing per writer."""

from __future__ import annotations

import os
import random

from gateway.store import ids
from gateway.store.ids import _ALPHABET, MonotonicUlid, _decode, _encode


def _reference(value: int) -> str:
    """One digit at a time, least significant first: the definition, slowly."""
    digits = []
    for _ in range(26):
        digits.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(digits))


def test_encoding_matches_the_definition_and_round_trips() -> None:
    rng = random.Random(7)
    for value in [
        0,
        1,
        31,
        32,
        1023,
        1024,
        (1 << 128) - 1,
        *(rng.getrandbits(128) for _ in range(2000)),
    ]:
        assert _encode(value) == _reference(value)
        assert _decode(_encode(value)) == value


def test_ids_made_in_one_millisecond_still_increase() -> None:
    make = MonotonicUlid()
    made = [make(1_700_000_000.0) for _ in range(1000)]
    assert made == sorted(made) and len(set(made)) == 1000
    assert all(len(i) == 26 for i in made)


def test_a_forked_child_does_not_draw_its_parent_s_ids() -> None:
    """`serve --workers N` forks: without a fresh seed in the child, parent and child would
    draw the same random part and could mint one id twice within a millisecond."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next draw, then out without running the test runner's exit
        os.write(write, ids._random.getrandbits(64).to_bytes(8, "big"))
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = int.from_bytes(os.read(read, 8), "big")
    os.close(read)
    assert child != ids._random.getrandbits(64)
