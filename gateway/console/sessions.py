"""Console sessions: a random token in an HttpOnly, SameSite=Strict cookie that expires, and a
CSRF token per session that every form carries.

Sessions live in this process's memory: a restart signs everyone out, which is the safe
failure. The cookie holds only the token; the book keeps the sha256 of it, so no token can be
read back out of it. Two kinds are kept apart, each with its own bound, so that a flood of
visitors who never sign in cannot push a signed-in operator out:

* a signed-in session (a client's key was shown, or the gateway runs open) for
  `SIGNED_IN_TTL_S`;
* a sign-in session, made for the sign-in form only, so that the form too carries a CSRF token
  (a forged sign-in would otherwise put a victim's browser in the attacker's session).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web

from gateway.console.access import Viewer

COOKIE = "fence_console"
SIGNED_IN_TTL_S = 8 * 3600.0
SIGN_IN_TTL_S = 30 * 60.0
MOST_SIGNED_IN = 10_000
MOST_SIGNING_IN = 1_000


@dataclass(frozen=True, slots=True)
class Flash:
    """A one-time message for the next page: what an action did, or why it did nothing."""

    kind: Literal["done", "refused"]
    text: str


@dataclass(slots=True)
class Session:
    viewer: Viewer
    csrf: str
    expires_at: float
    flashes: list[Flash] = field(default_factory=list)

    def take_flashes(self) -> list[Flash]:
        taken, self.flashes = self.flashes, []
        return taken


class SessionBook:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._signed_in: dict[str, Session] = {}
        self._signing_in: dict[str, Session] = {}

    def start(self, viewer: Viewer) -> tuple[str, Session]:
        """A new session for `viewer` (a new token, never a reused one); its token."""
        token = secrets.token_urlsafe(32)
        ttl = SIGNED_IN_TTL_S if viewer.signed_in else SIGN_IN_TTL_S
        session = Session(viewer, secrets.token_urlsafe(32), self._clock() + ttl)
        book, most = self._book_of(viewer)
        self._prune(book)
        while len(book) >= most:  # the one expiring first goes
            del book[min(book, key=lambda key: book[key].expires_at)]
        book[_digest(token)] = session
        return token, session

    def find(self, token: str | None) -> Session | None:
        if not token:
            return None
        key = _digest(token)
        for book in (self._signed_in, self._signing_in):
            session = book.get(key)
            if session is not None:
                if session.expires_at > self._clock():
                    return session
                del book[key]
        return None

    def end(self, token: str | None) -> None:
        if token:
            key = _digest(token)
            self._signed_in.pop(key, None)
            self._signing_in.pop(key, None)

    def __len__(self) -> int:
        return len(self._signed_in) + len(self._signing_in)

    def _book_of(self, viewer: Viewer) -> tuple[dict[str, Session], int]:
        if viewer.signed_in:
            return self._signed_in, MOST_SIGNED_IN
        return self._signing_in, MOST_SIGNING_IN

    def _prune(self, book: dict[str, Session]) -> None:
        now = self._clock()
        for key in [key for key, session in book.items() if session.expires_at <= now]:
            del book[key]


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def csrf_matches(session: Session | None, presented: str | None) -> bool:
    """The form's token is its session's, compared in constant time."""
    if session is None or presented is None:
        return False
    return hmac.compare_digest(session.csrf.encode(), presented.encode("utf-8", "surrogateescape"))


def set_cookie(response: web.StreamResponse, token: str, session: Session, secure: bool) -> None:
    """The session's cookie: script cannot read it, no other site's page can make the browser
    send it, and it ends with its session."""
    response.set_cookie(
        COOKIE,
        token,
        max_age=max(0, int(session.expires_at - time.time())),
        path="/_gateway/console",
        httponly=True,
        samesite="Strict",
        secure=secure,
    )


def clear_cookie(response: web.StreamResponse) -> None:
    response.del_cookie(COOKIE, path="/_gateway/console")
