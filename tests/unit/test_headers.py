"""Header parsing: docs/contract.md §3 steps 2 and 3, exactly."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.core import errors, grammar
from gateway.proxy import headers


def _h(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


class TestFence:
    """A fence is `[1-9][0-9]*` from 1 to 2^63-1 and nothing else."""

    @pytest.mark.parametrize("value", ["1", "42", "9223372036854775807"])
    def test_accepts(self, value: str) -> None:
        assert headers.parse_fence(_h(("X-Fence-Token", value))) == int(value)

    @pytest.mark.parametrize(
        "value",
        [
            "",
            "0",
            "-1",
            "+1",
            "01",
            "1_0",
            "1.0",
            " 1x",
            "١٢",
            "１",
            "9223372036854775808",
            "99999999999999999999999",
            "1e3",
            "0x10",
            "1\n",
        ],
    )
    def test_refuses(self, value: str) -> None:
        with pytest.raises(errors.InvalidFence):
            headers.parse_fence(_h(("X-Fence-Token", value)))

    def test_missing_is_428(self) -> None:
        with pytest.raises(errors.MissingFence):
            headers.parse_fence(_h())

    def test_twice_is_invalid(self) -> None:
        with pytest.raises(errors.InvalidFence):
            headers.parse_fence(_h(("X-Fence-Token", "1"), ("X-Fence-Token", "1")))

    @given(st.integers(min_value=1, max_value=2**63 - 1))
    def test_every_valid_integer_round_trips(self, fence: int) -> None:
        assert grammar.fence_value(str(fence)) == fence

    @given(st.text(max_size=25))
    def test_never_accepts_what_is_not_canonical(self, text: str) -> None:
        parsed = grammar.fence_value(text)
        assert parsed is None or str(parsed) == text


class TestResource:
    """Resources: 1 to 256 safe characters, clean `/`-separated segments."""

    @pytest.mark.parametrize(
        "value", ["browser/account-42", "a", "deploy/production", "x:y@z/_.-", "a" * 256]
    )
    def test_accepts(self, value: str) -> None:
        assert headers.parse_resource(_h(("X-Lease-Resource", value))) == value

    @pytest.mark.parametrize(
        "value",
        [
            "",
            "/a",
            "a/",
            "a//b",
            "a/./b",
            "a/../b",
            ".",
            "..",
            "a b",
            "a?b",
            "é",
            "a" * 257,
            "a/b\x00",
        ],
    )
    def test_refuses(self, value: str) -> None:
        with pytest.raises(errors.InvalidResource):
            headers.parse_resource(_h(("X-Lease-Resource", value)))

    def test_missing_is_428(self) -> None:
        with pytest.raises(errors.MissingResource):
            headers.parse_resource(_h())


class TestOtherHeaders:
    def test_owner_limits(self) -> None:
        assert headers.parse_owner(_h(("X-Lease-Owner", "run-8f21"))) == "run-8f21"
        assert headers.parse_owner(_h()) is None
        for bad in ("", "a b", "x" * 129):
            with pytest.raises(errors.InvalidRequest):
                headers.parse_owner(_h(("X-Lease-Owner", bad)))

    @pytest.mark.parametrize("bad", ["", "gw-mine", "has space", "k" * 256, "é"])
    def test_idempotency_key_refused(self, bad: str) -> None:
        with pytest.raises(errors.InvalidIdempotencyKey):
            headers.parse_idempotency_key(_h(("Idempotency-Key", bad)))

    def test_idempotency_key_accepted(self) -> None:
        key = "order-7!~" + "k" * 200
        assert headers.parse_idempotency_key(_h(("Idempotency-Key", key))) == key

    def test_strip_removes_hop_by_hop_and_connection_named(self) -> None:
        kept = headers.strip(
            _h(
                ("Connection", "keep-alive, X-Secret"),
                ("X-Secret", "s"),
                ("Keep-Alive", "5"),
                ("TE", "trailers"),
                ("Accept", "*/*"),
                ("Proxy-Authorization", "Bearer k"),
                ("X-Fence-Token", "3"),
            ),
            frozenset({"x-fence-token"}),
        )
        assert kept == [("Accept", "*/*")]
