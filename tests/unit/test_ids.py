"""Receipt ids (gateway.store.ids): Crockford base32 ULIDs, strictly increasing per writer,
each made from its millisecond and random part without the 130-bit number: the same digits
as encoding that number."""

from __future__ import annotations

import os
import random

from gateway.store import ids
from gateway.store.ids import _ALPHABET, MonotonicUlid, _decode, _encode, _encode_id


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


def test_the_id_of_a_millisecond_and_random_part_is_their_number_encoded() -> None:
    rng = random.Random(11)
    for ms in [
        0,
        1,
        1023,
        1024,
        1_800_000_000_000,
        (1 << 50) - 1,
        1 << 50,
        (1 << 60) + 12345,
        *(rng.getrandbits(48) for _ in range(500)),
    ]:
        for part in [
            0,
            1,
            1023,
            1024,
            (1 << 40) - 1,
            1 << 40,
            (1 << 80) - 1,
            *(rng.getrandbits(80) for _ in range(4)),
        ]:
            assert _encode_id(ms, part) == _encode((ms << 80) | part)


def test_made_ids_are_their_state_encoded_and_keep_order() -> None:
    make = MonotonicUlid()
    made = []
    for now in [
        1_800_000_000.0,
        1_800_000_000.0,
        1_800_000_000.5,
        1_799_000_000.0,
        1_900_000_000.25,
    ]:
        made.append(make(now))
        assert _decode(made[-1]) == (make._last_ms << 80) | make._last_random
    assert made == sorted(made) and len(set(made)) == len(made)


def test_a_millisecond_whose_ids_are_used_up_goes_on_in_the_next() -> None:
    """After an id whose random part is all ones (a restart's `continue_after` may take one),
    the next id in that millisecond would overflow the 80 bits: it is the next millisecond's
    first instead, still after the last."""
    make = MonotonicUlid()
    last = _encode((5 << 80) | ((1 << 80) - 1))
    make.continue_after(last)
    following = make(0)
    assert following > last and _decode(following) == 6 << 80
