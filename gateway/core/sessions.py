"""Sessions: fenced WebSockets (docs/contract.md §15), decided.

A session is an upgrade admitted like a call (its fence checked and advanced, a `pending`
receipt written), then relayed message by message until one of its ends. These functions say
what an end sends each side, what a session's receipt records, and when a session that is
still relaying must be cut because its fence or its lease is no longer current. The relay
(`gateway.proxy.sessions`) and the watch over open sessions (`gateway.upkeep.session_watch`)
ask them; they do no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from gateway.core.fences import Issuer
from gateway.core.times import rfc3339

ClosedBy = Literal[
    "client", "upstream", "fenced", "lease_ended", "idle", "limit", "shutdown", "error"
]
CLOSED_BY: tuple[ClosedBy, ...] = get_args(ClosedBy)

# Close codes (RFC 6455 §7.4): what the gateway itself ends a session with.
NORMAL = 1000
GOING_AWAY = 1001
NO_STATUS = 1005  # recorded when a close frame carried no code; never sent
ABNORMAL = 1006  # recorded when a side went away without a close frame; never sent
MESSAGE_TOO_BIG = 1009
INTERNAL_ERROR = 1011
BAD_GATEWAY = 1014  # "acting as a gateway, got an invalid answer from upstream"
LEASE_EXPIRED = 4408
STALE_FENCE = 4409


@dataclass(frozen=True, slots=True)
class Ending:
    """How a session ended: who or what ended it, the code that ended it (as the receipt
    records it), and the close frames the gateway sends each side."""

    closed_by: ClosedBy
    close_code: int
    to_client: int
    to_upstream: int
    reason: str = ""


def sendable(code: int | None) -> int:
    """A close code that may go in a close frame (RFC 6455 §7.4.1): 1000 to 1003, 1007 to
    1014 and 3000 to 4999 pass on as they are; a missing, reserved or unknown code becomes
    1000."""
    if code is None:
        return NORMAL
    if 1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999:
        return code
    return NORMAL


def closed_by_client(code: int | None, reason: str = "") -> Ending:
    """The client closed: its code goes on to the upstream. `None`: the client went away
    without a close frame (recorded 1006, the upstream is told 1001)."""
    if code is None:
        return Ending("client", ABNORMAL, GOING_AWAY, GOING_AWAY, "client_gone")
    recorded = code if code else NO_STATUS
    return Ending("client", recorded, sendable(code), sendable(code), reason)


def closed_by_upstream(code: int | None, reason: str = "") -> Ending:
    """The upstream closed: its code goes on to the client. `None`: the connection broke
    without a close frame (recorded 1006, the client is told 1014)."""
    if code is None:
        return Ending("upstream", ABNORMAL, BAD_GATEWAY, GOING_AWAY, "upstream_gone")
    recorded = code if code else NO_STATUS
    return Ending("upstream", recorded, sendable(code), sendable(code), reason)


def ended_by_gateway(closed_by: ClosedBy, reason: str | None = None) -> Ending:
    """An end the gateway decides: both sides get the same code."""
    code, default_reason = _GATEWAY_ENDS[closed_by]
    return Ending(closed_by, code, code, code, reason or default_reason)


_GATEWAY_ENDS: dict[ClosedBy, tuple[int, str]] = {
    "fenced": (STALE_FENCE, "stale_fence"),
    "lease_ended": (LEASE_EXPIRED, "lease_expired"),
    "idle": (GOING_AWAY, "idle"),
    "limit": (MESSAGE_TOO_BIG, "message_too_big"),
    "shutdown": (GOING_AWAY, "shutdown"),
    "error": (INTERNAL_ERROR, "error"),
}


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """The receipt's `session` object (docs/contract.md §15). `in`: from the client to the
    upstream; `out`: back. Bytes are payload bytes of text and binary messages."""

    opened_at: float
    closed_at: float | None = None
    closed_by: ClosedBy | None = None
    close_code: int | None = None
    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def closed(self, ending: Ending, at: float) -> SessionRecord:
        return replace(self, closed_at=at, closed_by=ending.closed_by, close_code=ending.close_code)

    def to_json(self) -> dict[str, Any]:
        return {
            "opened_at": rfc3339(self.opened_at),
            "closed_at": rfc3339(self.closed_at),
            "closed_by": self.closed_by,
            "close_code": self.close_code,
            "messages_in": self.messages_in,
            "messages_out": self.messages_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
        }


@dataclass(frozen=True, slots=True)
class FenceState:
    """What the store says now about a resource with open sessions: its highest accepted
    fence, and its gateway-issued lease (fence, and whether it is held and unexpired by the
    store's clock)."""

    accepted: int
    lease_fence: int | None = None
    lease_live: bool = False


def watch_verdict(fence: int, issuer: Issuer, state: FenceState | None) -> ClosedBy | None:
    """Whether an open session of `fence` must be cut now (docs/contract.md §15): `fenced`
    once a higher fence was accepted for its resource (by any process sharing the store);
    with `issuer: gateway`, `lease_ended` once its lease is no longer the live lease of that
    fence (expired, released, revoked, or taken over). None: it goes on."""
    if state is not None and state.accepted > fence:
        return "fenced"
    if issuer == "gateway" and (
        state is None or state.lease_fence != fence or not state.lease_live
    ):
        return "lease_ended"
    return None
