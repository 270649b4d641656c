"""Running the gateway: bind, serve, and on SIGTERM drain and exit 0 (docs/contract.md §9)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
from urllib.parse import urlsplit, urlunsplit

from aiohttp import web

from gateway.config.clients import Clients
from gateway.config.policy import PolicySet
from gateway.config.settings import Settings
from gateway.observe import logs
from gateway.proxy import appkeys
from gateway.server.app import create_app
from gateway.server.http_server import GatewayRunner


class ConfigError(Exception):
    """Configuration that keeps the gateway from starting: exit status 2."""


def check_open_bind(settings: Settings) -> None:
    """Without a clients file the gateway is open: only loopback, unless allowed."""
    if settings.clients:
        return
    if not _is_loopback(settings.host) and not settings.allow_open:
        raise ConfigError(
            f"refusing to serve {settings.host} without GATEWAY_CLIENTS: anyone who can reach "
            "it could act as any agent. Set GATEWAY_CLIENTS, bind 127.0.0.1, or set "
            "GATEWAY_ALLOW_OPEN=true to accept the risk"
        )
    logs.event(
        "running_open", logging.WARNING, detail="no GATEWAY_CLIENTS: every caller is trusted"
    )


def check_tracing(settings: Settings) -> None:
    """GATEWAY_OTEL=true needs the otel extra and the exporters OTEL_TRACES_EXPORTER names:
    found at start, not at the first call (docs/contract.md §21)."""
    if not settings.otel:
        return
    try:
        from gateway.proxy import traces
    except ImportError as exc:
        raise ConfigError(
            f"GATEWAY_OTEL=true needs the otel extra (pip install 'fence-gateway[otel]'): "
            f"{exc.name or exc} is not installed"
        ) from None
    try:
        traces.exporter_classes()
    except traces.TracingError as exc:
        raise ConfigError(str(exc)) from None


def without_password(url: str) -> str:
    """A database URL fit for a log line."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve(
    settings: Settings, policies: PolicySet, clients: Clients | None, *, reuse_port: bool = False
) -> None:
    """Serve until SIGTERM or SIGINT. `reuse_port`: one of several workers on one port."""
    app = create_app(settings, policies, clients)
    runner = GatewayRunner(
        app,
        header_timeout_s=settings.header_timeout_s,
        keepalive_timeout=75,  # idle keep-alive connections; aiohttp's default is an hour
        access_log=None,
        handler_cancellation=False,  # a call admitted must complete even if the client leaves
        auto_decompress=False,  # bodies pass byte for byte
        shutdown_timeout=settings.shutdown_grace_s,
    )
    try:
        await runner.setup()
    except Exception as exc:
        await runner.cleanup()
        raise ConfigError(f"cannot start: {exc}") from exc
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    site = web.TCPSite(
        runner, settings.host, settings.port, reuse_address=True, reuse_port=reuse_port or None
    )
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"cannot listen on {settings.host}:{settings.port}: {exc}") from exc
    logs.event(
        "serving",
        host=settings.host,
        port=settings.port,
        instance=app[appkeys.STORE].instance,
        database=without_password(settings.database_url),
        upstreams=",".join(sorted(policies.upstreams)),
    )
    await stop.wait()
    logs.event("stopping", detail=f"draining calls for up to {settings.shutdown_grace_s}s")
    await runner.cleanup()  # stops accepting, lets handlers finish, then closes the store
    logs.event("stopped")
