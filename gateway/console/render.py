"""Pages from templates: one Jinja2 environment (HTML escaped everywhere), and the headers
every console answer carries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from gateway.console import paths, tallies
from gateway.core.times import rfc3339

_HERE = Path(__file__).parent
STATIC = _HERE / "static"

_ENVIRONMENT = jinja2.Environment(
    loader=jinja2.FileSystemLoader(_HERE / "templates"),
    autoescape=True,  # every value is escaped unless a template says otherwise (none does)
    undefined=jinja2.StrictUndefined,  # a missing value is a bug to see, not an empty cell
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENVIRONMENT.globals.update(
    prefix=paths.PREFIX,
    resource_page=paths.resource_page,
    time=rfc3339,
    duration=tallies.duration,
    clock=tallies.clock,
)

# Nothing is loaded from elsewhere, nothing may frame the console, and forms post only to it.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",  # pages hold receipts and the session's form token
}


def page(template: str, status: int = 200, **context: Any) -> web.Response:
    html = _ENVIRONMENT.get_template(template).render(**context)
    return web.Response(status=status, text=html, content_type="text/html", charset="utf-8")


def redirect(location: str) -> web.Response:
    """After a form: 303, so that reloading the next page does not post the form again."""
    return web.Response(status=303, headers={"Location": location})
