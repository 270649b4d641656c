"""What every backend writes for a receipt, whatever the backend."""

import json

from hypothesis import given
from hypothesis import strategies as st

from gateway.store.rows import headers_json


class TestHeadersJson:
    """An answer's headers are stored as the very text json.dumps makes of them."""

    @given(st.lists(st.tuples(st.text(), st.text()), max_size=8))
    def test_the_text_of_json_dumps(self, headers: list[tuple[str, str]]) -> None:
        assert headers_json(headers) == json.dumps(headers)

    def test_what_is_not_pairs_of_strings_is_left_to_json_dumps(self) -> None:
        odd = [[("a", 1)], [("a", None)], [("a", "b", "c")], [("a", ("b",))]]
        for headers in odd:
            assert headers_json(headers) == json.dumps(headers)  # type: ignore[arg-type]
