"""A request head as the wire writes it: the headers in the order given, the body's length,
and nothing that could end a header early."""

from __future__ import annotations

import pytest

from gateway.wire.errors import Unencodable
from gateway.wire.request import encode_head


def test_the_head_lists_the_headers_in_order_then_the_body_s_length() -> None:
    head = encode_head("POST", "/api/x?q=1", [("Host", "tool:1"), ("X-A", "é")], b"{}")
    assert (
        head
        == (
            "POST /api/x?q=1 HTTP/1.1\r\nHost: tool:1\r\nX-A: é\r\nContent-Length: 2\r\n\r\n"
        ).encode()
    )


@pytest.mark.parametrize(
    ("method", "length"),
    [("GET", None), ("HEAD", None), ("OPTIONS", None), ("DELETE", "0"), ("POST", "0")],
)
def test_a_request_without_a_body(method: str, length: str | None) -> None:
    """`Content-Length: 0` unless the method never carries a body, as aiohttp's client."""
    head = encode_head(method, "/", [("Host", "t")], None)
    expected = f"{method} / HTTP/1.1\r\nHost: t\r\n"
    expected += f"Content-Length: {length}\r\n\r\n" if length else "\r\n"
    assert head == expected.encode()


@pytest.mark.parametrize(
    ("target", "headers"),
    [
        ("/x", [("X-A", "a\r\nX-Fence-Token: 9")]),
        ("/x", [("X-A", "a\nb")]),
        ("/x", [("X-A\r\nX-B", "b")]),
        ("/x\r\nX-B: c", []),
        ("/x", [("X-A", "a\udcffb")]),  # a lone surrogate: bytes that were never UTF-8
    ],
    ids=["crlf-in-value", "lf-in-value", "crlf-in-name", "crlf-in-target", "surrogate"],
)
def test_a_head_that_cannot_be_written_as_it_is_is_refused(
    target: str, headers: list[tuple[str, str]]
) -> None:
    with pytest.raises(Unencodable):
        encode_head("GET", target, [("Host", "t"), *headers], None)
