"""Where the console's pages live, and the one rule for where a form may send the browser back."""

from __future__ import annotations

import re
from urllib.parse import quote

PREFIX = "/_gateway/console"
SIGN_IN = f"{PREFIX}/signin"
QUEUE = f"{PREFIX}/queue"
LEASES = f"{PREFIX}/leases"

# A path inside the console, with an optional query: no scheme, no host, no "//" (which a
# browser would read as another host), no backslash (which some read as "/").
_LOCAL = re.compile(r"/_gateway/console(?:/[A-Za-z0-9._\-:@/%]*)?(?:\?[A-Za-z0-9._\-:@/%=&+]*)?")
# A "." or ".." path segment, also percent-encoded: a browser resolves it, out of the console
_DOT_SEGMENT = re.compile(r"(?:\.|%2e){1,2}", re.IGNORECASE)


def resource_page(resource: str) -> str:
    return f"{PREFIX}/resources/{quote(resource, safe='/:@')}"


def back_to(value: str | None, default: str) -> str:
    """Where to send the browser after a form: `value` when it is a console path, else
    `default`, so no form can be made to redirect anywhere else."""
    if value is None or len(value) > 2000 or "//" in value or not _LOCAL.fullmatch(value):
        return default
    path = value.partition("?")[0]
    if any(_DOT_SEGMENT.fullmatch(segment) for segment in path.split("/")):
        return default
    return value
