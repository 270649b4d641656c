"""`mount(app)`: the console's routes and its session book, added to the gateway's app before
its catch-all routes. Every path under /_gateway/console answers here, in HTML, whatever the
method; the server's authentication leaves these paths to the console's own sign-in."""

from __future__ import annotations

from aiohttp import web

from gateway.console import actions, pages, signin
from gateway.console.guard import SESSIONS, Endpoint, serve
from gateway.console.paths import PREFIX
from gateway.console.sessions import SessionBook

ENDPOINTS: dict[str, Endpoint] = {
    PREFIX: Endpoint(get=pages.overview),
    f"{PREFIX}/": Endpoint(get=pages.overview),
    f"{PREFIX}/queue": Endpoint(get=pages.queue),
    f"{PREFIX}/leases": Endpoint(get=pages.leases),
    f"{PREFIX}/resources/{{resource:.+}}": Endpoint(get=pages.resource),
    f"{PREFIX}/receipts/{{id}}/resolve": Endpoint(post=actions.resolve, need="resolve"),
    f"{PREFIX}/receipts/{{id}}/probe": Endpoint(post=actions.probe, need="resolve"),
    f"{PREFIX}/leases/revoke": Endpoint(post=actions.revoke, need="revoke"),
    f"{PREFIX}/signin": Endpoint(get=signin.form, post=signin.sign_in, need="nothing"),
    f"{PREFIX}/signout": Endpoint(post=signin.sign_out, need="nothing"),
    f"{PREFIX}/static/{{name}}": Endpoint(get=pages.static, need="nothing"),
    f"{PREFIX}/{{tail:.*}}": Endpoint(
        get=pages.not_found,
        post=pages.not_found,
        other=pages.not_found,
        need="nothing",
        csrf=False,
    ),
}


def mount(app: web.Application) -> None:
    app[SESSIONS] = SessionBook()
    for path, endpoint in ENDPOINTS.items():
        app.router.add_route("*", path, serve(endpoint))
