"""Every console request passes here: who is looking (the session cookie), whether they may
(docs/contract.md §10 roles), the form's CSRF token, and any error turned into an HTML page.

Errors are answered in the console's own protocol, a page a person reads, never the API's
problem+json and never a 500 for bad input: the handlers raise the gateway's errors
(`gateway.core.errors`) as the API does, and they are rendered here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from multidict import MultiDictProxy

from gateway.console import paths, render
from gateway.console.access import LOCAL_OPERATOR, NOBODY, Viewer
from gateway.console.sessions import (
    COOKIE,
    Flash,
    Session,
    SessionBook,
    csrf_matches,
    set_cookie,
)
from gateway.core import errors
from gateway.observe import logs
from gateway.proxy import appkeys

SESSIONS: web.AppKey[SessionBook] = web.AppKey("console_sessions")

Need = Literal["nothing", "read", "resolve", "revoke"]
Form = MultiDictProxy[str | bytes | bytearray | web.FileField]


@dataclass
class Visit:
    """One request to the console, as its handler sees it."""

    request: web.Request
    viewer: Viewer
    session: Session | None
    form: Form | None = None
    cookie: tuple[str, Session] | None = field(default=None)  # a new session's token to set

    @property
    def app(self) -> web.Application:
        return self.request.app

    def start_session(self, viewer: Viewer) -> Session:
        """Replace this browser's session with a new one (a new token: nothing carries over)."""
        book = self.app[SESSIONS]
        book.end(self.request.cookies.get(COOKIE))
        token, session = book.start(viewer)
        self.session, self.viewer, self.cookie = session, viewer, (token, session)
        return session

    def end_session(self) -> None:
        self.app[SESSIONS].end(self.request.cookies.get(COOKIE))
        self.session, self.viewer, self.cookie = None, NOBODY, None

    def flash(self, kind: Literal["done", "refused"], text: str) -> None:
        if self.session is not None:
            self.session.flashes.append(Flash(kind, text))

    def field(self, name: str, required: bool = True) -> str | None:
        """A form field sent once as text; `400` when it is missing (and required), repeated,
        or a file."""
        values = self.form.getall(name, []) if self.form is not None else []
        if len(values) > 1:
            raise errors.InvalidRequest(f"the form field {name!r} was sent {len(values)} times")
        if not values:
            if required:
                raise errors.InvalidRequest(f"the form field {name!r} is missing")
            return None
        if not isinstance(values[0], str):
            raise errors.InvalidRequest(f"the form field {name!r} must be text, not a file")
        try:  # a charset such as unicode_escape can decode to a lone surrogate: no text
            values[0].encode("utf-8")
        except UnicodeEncodeError:
            raise errors.InvalidRequest(f"the form field {name!r} is not Unicode text") from None
        return values[0]

    def page(self, template: str, status: int = 200, **context: Any) -> web.Response:
        """A page with what every page shows: who is looking, the form token, the flashes."""
        return render.page(
            template,
            status,
            viewer=self.viewer,
            csrf=self.session.csrf if self.session is not None else "",
            flashes=self.session.take_flashes() if self.session is not None else [],
            **context,
        )


Handler = Callable[[Visit], Awaitable[web.Response]]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A console path: its GET and POST handlers, and the permission both need."""

    get: Handler | None = None
    post: Handler | None = None
    need: Need = "read"
    csrf: bool = True  # False only where a POST changes nothing (the "no such page" answer)
    other: Handler | None = None  # any other method (the "no such page" answer: 404, not 405)

    @property
    def allowed(self) -> list[str]:
        return (["GET", "HEAD"] if self.get else []) + (["POST"] if self.post else [])


def serve(endpoint: Endpoint) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        visit = Visit(request, NOBODY, None)
        try:
            response = await _answer(endpoint, visit)
        except errors.GatewayError as error:
            response = _error_page(visit, error.status, error.title, error.detail)
            response.headers.update(error.headers)
        except web.HTTPException as exc:  # aiohttp's own refusals: a body too large, …
            if exc.status < 400:
                raise
            response = _error_page(visit, exc.status, exc.reason, exc.text or exc.reason)
        except Exception:  # a bug: the page says so, the trace goes to the log only
            logs.log.exception("console failed on %s %s", request.method, request.path)
            response = _error_page(
                visit, 500, "Internal error", "the console failed unexpectedly; see its log"
            )
        if visit.cookie is not None:
            token, session = visit.cookie
            set_cookie(response, token, session, request.secure)
        response.headers.update(render.SECURITY_HEADERS)
        return response

    return handle


async def _answer(endpoint: Endpoint, visit: Visit) -> web.Response:
    request = visit.request
    method = "GET" if request.method == "HEAD" else request.method
    handler = endpoint.get if method == "GET" else endpoint.post if method == "POST" else None
    handler = handler or endpoint.other
    _who(visit)
    if handler is None:
        allowed = endpoint.allowed
        raise errors.MethodNotAllowed(
            f"{request.path} takes {', '.join(allowed)}, not {request.method}",
            headers={"Allow": ", ".join(allowed)},
        )
    if endpoint.need != "nothing":
        if not visit.viewer.signed_in:
            if method == "GET":
                return render.redirect(paths.SIGN_IN)
            raise errors.Unauthenticated("sign in first: this session has ended or never began")
        if not getattr(visit.viewer.may, endpoint.need):
            raise errors.Forbidden(_refusal(visit.viewer, endpoint.need))
    if method == "POST" and endpoint.csrf:
        visit.form = await _read_form(request)
        if not csrf_matches(visit.session, visit.field("csrf", required=False)):
            raise errors.Forbidden(
                "the form's CSRF token is missing or is not this session's: reload the page "
                "and send the form again"
            )
    return await handler(visit)


def _who(visit: Visit) -> None:
    """The session the cookie names; in open mode, a new one for a browser without one."""
    request = visit.request
    book = request.app[SESSIONS]
    session = book.find(request.cookies.get(COOKIE))
    if session is None and request.app[appkeys.CLIENTS] is None:
        token, session = book.start(LOCAL_OPERATOR)
        visit.cookie = (token, session)
    if session is not None:
        visit.session, visit.viewer = session, session.viewer


def _refusal(viewer: Viewer, need: Need) -> str:
    roles = ", ".join(sorted(viewer.roles)) or "no role"
    what = {"read": "see the console", "resolve": "resolve receipts", "revoke": "revoke leases"}
    return f"client {viewer.name} ({roles}) may not {what.get(need, need)}"


async def _read_form(request: web.Request) -> Form:
    timeout_s = request.app[appkeys.SETTINGS].body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            return await request.post()  # at most the app's client_max_size: 413 above
    except TimeoutError:
        raise errors.RequestTimeout(f"the form did not arrive within {timeout_s}s") from None
    except web.HTTPException:
        raise
    except Exception as exc:  # a malformed body in any of the ways a parser can refuse one
        raise errors.InvalidRequest(f"the form could not be read: {exc}") from None


def _error_page(visit: Visit, status: int, title: str, detail: str) -> web.Response:
    if status >= 500:
        logs.event("console_error", logging.WARNING, status=status, detail=detail)
    return visit.page("error.html", status, code=status, title=title, detail=detail)
