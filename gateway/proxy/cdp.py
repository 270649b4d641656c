"""CDP discovery through the gateway (docs/contract.md §15, "CDP discovery").

A Chrome DevTools Protocol client first asks the browser's HTTP endpoint where its WebSockets
are (`GET /json/version`, `/json/list`, `/json`, and the fenced `PUT /json/new`), then
connects to the `webSocketDebuggerUrl` it was told. For an upstream with `cdp: true` those
answers are rewritten so that every WebSocket URL in them points at the gateway's own address
and mount: the client then opens its session through the gateway, fenced, and never learns
the browser's own address. Only `webSocketDebuggerUrl` and the `ws=`/`wss=` parameter of
`devtoolsFrontendUrl` change; every other field is passed on as it came.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from aiohttp import web

from gateway.config.policy import Upstream
from gateway.config.settings import Settings
from gateway.proxy.relay import Head, is_trusted

# Discovery answers are small JSON documents (one entry per tab); one larger than this is
# passed on as it came.
DISCOVERY_MAX_BYTES = 4 * 1024 * 1024
_LISTS = frozenset({"/json/version", "/json/list", "/json"})
_NEW = "/json/new"
_HOST = re.compile(r"[A-Za-z0-9.\-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


@dataclass(frozen=True, slots=True)
class PublicBase:
    """Where clients reach an upstream's WebSockets through the gateway: `ws` or `wss`, the
    authority, and the path up to and with the mount."""

    scheme: str
    authority: str
    path: str


def is_discovery(upstream: Upstream, method: str, rest: str) -> bool:
    """A discovery call of a `cdp: true` upstream, whose answer is rewritten."""
    if not upstream.cdp:
        return False
    path = rest.partition("?")[0]
    if path.endswith("/") and len(path) > 1:
        path = path[:-1]
    return (method == "GET" and path in _LISTS) or (method == "PUT" and path == _NEW)


def public_base(request: web.Request, upstream: Upstream, settings: Settings) -> PublicBase:
    """`GATEWAY_PUBLIC_URL` when set; else the `Host` the client used, `wss` when the
    connection is TLS or a trusted proxy's `X-Forwarded-Proto` says `https`."""
    if settings.public_url:
        parts = urlsplit(settings.public_url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        return PublicBase(scheme, parts.netloc, parts.path.rstrip("/") + upstream.mount)
    host = request.headers.get("Host", "")
    if not _HOST.fullmatch(host):
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        if sockname:
            address = sockname[0]
            host = f"[{address}]:{sockname[1]}" if ":" in address else f"{address}:{sockname[1]}"
        else:
            host = "127.0.0.1"
    secure = request.scheme == "https"
    forwarded = request.headers.get("X-Forwarded-Proto")
    if forwarded and is_trusted(request.remote or "", settings.trusted_networks):
        secure = forwarded.split(",")[0].strip().lower() == "https"
    return PublicBase("wss" if secure else "ws", host, upstream.mount)


def rewrite_head(head: Head, base: PublicBase, upstream: Upstream) -> Head:
    """The answer with its WebSocket URLs rewritten; as it was when it is not a whole,
    successful JSON answer."""
    if not head.complete or head.broken or not 200 <= head.status < 300:
        return head
    body = rewrite_body(head.prefix, base, upstream)
    if body is None:
        return head
    headers = [(k, v) for k, v in head.headers if k.lower() != "content-length"]
    headers.append(("Content-Length", str(len(body))))
    return replace(head, headers=headers, prefix=body)


def rewrite_body(body: bytes, base: PublicBase, upstream: Upstream) -> bytes | None:
    """A discovery document (one object, or a list of them) rewritten; None when it is not
    JSON of that shape."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    entries = document if isinstance(document, list) else [document]
    if not all(isinstance(entry, dict) for entry in entries):
        return None
    base_path = urlsplit(upstream.url).path.rstrip("/")
    for entry in entries:
        _rewrite_entry(entry, base, base_path)
    return json.dumps(document, indent=2).encode()


def _rewrite_entry(entry: dict[str, Any], base: PublicBase, base_path: str) -> None:
    url = entry.get("webSocketDebuggerUrl")
    if isinstance(url, str):
        entry["webSocketDebuggerUrl"] = ws_url(url, base, base_path)
    frontend = entry.get("devtoolsFrontendUrl")
    if isinstance(frontend, str):
        entry["devtoolsFrontendUrl"] = frontend_url(frontend, base, base_path)


def ws_url(url: str, base: PublicBase, base_path: str) -> str:
    """`ws://browser:9222/devtools/page/X` → `ws://gateway:8080/mount/devtools/page/X`."""
    parts = urlsplit(url)
    path = _below(parts.path, base_path)
    return urlunsplit((base.scheme, base.authority, base.path + path, parts.query, ""))


def frontend_url(url: str, base: PublicBase, base_path: str) -> str:
    """The `ws=` (or `wss=`) parameter of a DevTools frontend URL, whose value is an address
    without a scheme (`browser:9222/devtools/page/X`), pointed at the gateway; the rest of
    the URL as it was."""
    head, mark, query = url.partition("?")
    if not mark:
        return url
    query, hash_mark, fragment = query.partition("#")
    params = []
    for param in query.split("&"):
        name, equals, value = param.partition("=")
        if equals and name in ("ws", "wss"):
            path = _below("/" + value.partition("/")[2], base_path)
            param = f"{base.scheme}={base.authority}{base.path}{path}"
        params.append(param)
    return f"{head}?{'&'.join(params)}{hash_mark}{fragment}"


def _below(path: str, base_path: str) -> str:
    """`path` without the upstream URL's base path, when it lies under it."""
    if base_path and (path == base_path or path.startswith(base_path + "/")):
        return path[len(base_path) :]
    return path
