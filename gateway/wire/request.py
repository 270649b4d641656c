"""A request as the bytes that go on the wire: its head, then its body as it is.

The head lists the headers in the order given (the caller puts `Host` first), then the body's
`Content-Length`: the body is always sent whole with its length, never chunked, since the
call path has read it before admission. A request without a body gets `Content-Length: 0`
unless its method never carries one, as aiohttp's client did, so a tool sees the same head.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.wire.errors import Unencodable

# Methods whose requests carry no body by convention: no `Content-Length: 0` is added.
_BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


def encode_head(
    method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes | None
) -> bytes:
    """The request line and headers, ending in the blank line; raise `Unencodable`.

    A CR or LF inside a name or value would end the header early and let the rest be read as
    headers of its own (header injection): the whole head is refused instead. Counting line
    ends over the joined head checks every value in two passes of C code.
    """
    lines = [f"{name}: {value}\r\n" for name, value in headers]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}\r\n")
    elif method not in _BODYLESS:
        lines.append("Content-Length: 0\r\n")
    lines.append("\r\n")
    text = f"{method} {target} HTTP/1.1\r\n" + "".join(lines)
    ends = len(lines) + 1  # the request line's too
    if text.count("\n") != ends or text.count("\r") != ends:
        raise Unencodable("a CR or LF in the request line or a header")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise Unencodable(f"the request head is not encodable: {exc.reason}") from None
