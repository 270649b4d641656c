"""A receipt id is made from its millisecond and random part without the 130-bit number
(gateway.store.ids): the same digits as encoding that number."""

import random

from gateway.store.ids import MonotonicUlid, _decode, _encode, _encode_id


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
