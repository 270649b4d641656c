"""Signing in with a client's key, and out.

The key is checked by the clients file's own `identify` (sha256, constant time), exactly as an
`Authorization: Bearer` header is; a client whose roles give it nothing here (an agent) is
refused. A successful sign-in starts a new session, so a session token made before it (the
sign-in form's) is worth nothing after it.
"""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.console import paths, render
from gateway.console.access import NOBODY, client_viewer
from gateway.console.guard import Visit
from gateway.console.sessions import clear_cookie
from gateway.core import errors
from gateway.observe import logs
from gateway.proxy import appkeys


async def form(visit: Visit) -> web.Response:
    if visit.app[appkeys.CLIENTS] is None or visit.viewer.signed_in:
        return render.redirect(paths.PREFIX)  # open, or signed in already: nothing to do
    if visit.session is None:
        visit.start_session(NOBODY)  # carries the form's CSRF token
    return visit.page("signin.html")


async def sign_in(visit: Visit) -> web.Response:
    clients = visit.app[appkeys.CLIENTS]
    if clients is None:
        return render.redirect(paths.PREFIX)
    key = visit.field("key") or ""
    try:
        client = clients.identify([f"Bearer {key}"])
    except errors.Unauthenticated:
        logs.event("console_sign_in_refused", logging.WARNING, reason="unknown key")
        return visit.page("signin.html", 401, refusal="That key names no client.")
    viewer = client_viewer(client.name, client.roles)
    if not viewer.may.read:
        logs.event("console_sign_in_refused", logging.WARNING, client=client.name, reason="role")
        raise errors.Forbidden(
            f"client {client.name} has the role {', '.join(sorted(client.roles))}: the console "
            "is for reconcilers and admins (an agent acts through the gateway, not here)"
        )
    visit.start_session(viewer)
    logs.event("console_sign_in", client=client.name, roles=",".join(sorted(client.roles)))
    return render.redirect(paths.PREFIX)


async def sign_out(visit: Visit) -> web.Response:
    visit.end_session()
    open_mode = visit.app[appkeys.CLIENTS] is None  # nobody signs in: back to the overview
    response = render.redirect(paths.PREFIX if open_mode else paths.SIGN_IN)
    clear_cookie(response)
    return response
