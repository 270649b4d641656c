"""What can go wrong on the wire, by whether the request may have reached the peer.

    WireError
    ├── NotSent            nothing of the request left this process: it may be tried anew
    │   ├── ConnectError   no connection: refused, no such host, TLS handshake, no free slot
    │   │   └── HandshakeRefused  the peer's TLS alert ended the handshake after our write
    │   ├── Unencodable    the request head cannot be written as HTTP/1.1
    │   └── Withdrawn      the last check before the write said no
    └── MaybeSent          the request was written: the peer may have acted on it
        ├── ReadTimeout    no (whole) answer by the deadline
        └── BrokenAnswer   the answer did not arrive whole
            ├── ReadError      the connection ended or failed before the answer did
            └── ProtocolError  the peer's bytes are no HTTP/1.1 answer

Like httpcore's, the type decides: a caller never reads a message to learn whether to say
"not sent" or "outcome unknown".
"""

from __future__ import annotations


class WireError(Exception):
    """Any failure of an exchange on the wire."""


class NotSent(WireError):
    """Nothing of the request was written."""


class ConnectError(NotSent):
    """No connection to the peer could be had (including a connect or pool timeout)."""


class HandshakeRefused(ConnectError):
    """The peer's TLS layer refused the handshake (TLS 1.3 checks the client certificate
    after the client's side is done, so the alert may come after the request was written):
    it passed nothing of the request on."""


class Unencodable(NotSent):
    """The request head holds what HTTP/1.1 cannot carry (a CR or LF, a lone surrogate)."""


class Withdrawn(NotSent):
    """The caller's last check, asked just before the write, said no."""


class MaybeSent(WireError):
    """The request was written, wholly or in part: the peer may have acted on it."""


class ReadTimeout(MaybeSent):
    """The answer's head did not arrive by the deadline."""


class BrokenAnswer(MaybeSent):
    """The answer broke off or broke HTTP/1.1; a body read raises it too."""


class ReadError(BrokenAnswer):
    """The connection closed or failed before the answer ended."""


class ProtocolError(BrokenAnswer):
    """What the peer sent is not a valid HTTP/1.1 answer (httptools' strict parser says no)."""
