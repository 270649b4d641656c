"""Running the gateway: bind (HTTPS when configured), serve, on SIGHUP read the certificate
again, and on SIGTERM drain and exit 0 (docs/contract.md §9, §22)."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import os
import signal
import ssl
import sys
from urllib.parse import urlsplit, urlunsplit

from gateway.config.clients import Clients
from gateway.config.policy import PolicySet
from gateway.config.settings import Settings
from gateway.config.tls import TlsField, TlsFileError, reload_pair, server_context
from gateway.observe import logs
from gateway.proxy import appkeys
from gateway.server.app import create_app
from gateway.server.http_server import GatewayRunner, GatewaySite
from gateway.server.workers import HELD_SIGNALS, SUPERVISOR_ENV

# Connections the kernel may hold accepted or half-open before the loop takes them (it caps
# this at net.core.somaxconn). asyncio's 128 drops the SYNs of a crowd that connects at once
# (2,000 agents after a restart): each dropped client waits out a retransmission, a second
# or more, before its first call is even read.
LISTEN_BACKLOG = 4096
# A thread that wants the GIL gets it within this, not CPython's 5 ms: the SQLite store's
# writer takes it a few times a batch (gateway.store.group_commit), and under load the event
# loop lets go of it only when made to, while every call of the batch waits (fenced calls at
# 32 connections: 1.03-1.28× the rate with 5 ms, in paired rounds).
GIL_SWITCH_INTERVAL_S = 50e-6


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


# The setting that names each file of the gateway's own TLS, for messages.
_TLS_SETTING: dict[TlsField, str] = {
    "cert_file": "GATEWAY_TLS_CERT",
    "key_file": "GATEWAY_TLS_KEY",
    "ca_file": "GATEWAY_TLS_CLIENT_CA",
}


def serving_tls(settings: Settings) -> ssl.SSLContext | None:
    """The context the gateway serves HTTPS with, its files read now; None: plain HTTP."""
    cert, key = settings.tls_cert or None, settings.tls_key or None  # empty: unset
    if cert is None and key is None:
        if settings.tls_client_ca:
            raise ConfigError(
                "GATEWAY_TLS_CLIENT_CA needs GATEWAY_TLS_CERT and GATEWAY_TLS_KEY: client "
                "certificates are asked for in the TLS handshake of an HTTPS gateway"
            )
        return None
    if cert is None or key is None:
        raise ConfigError(
            "GATEWAY_TLS_CERT and GATEWAY_TLS_KEY go together: set both to serve HTTPS, or neither"
        )
    try:
        return server_context(cert, key, settings.tls_client_ca)
    except TlsFileError as exc:
        raise ConfigError(f"{_TLS_SETTING[exc.field]}: {exc}") from None


def reload_tls(context: ssl.SSLContext | None, settings: Settings) -> None:
    """SIGHUP: the certificate and key read again into the live context; a pair that will
    not load is logged and the one in use kept."""
    if context is None or not settings.tls_cert or not settings.tls_key:
        logs.event("tls_reload_skipped", detail="SIGHUP, but the gateway serves plain HTTP")
        return
    try:
        reload_pair(context, settings.tls_cert, settings.tls_key)
    except TlsFileError as exc:
        logs.event(
            "tls_reload_failed",
            logging.ERROR,
            detail=f"{_TLS_SETTING[exc.field]}: {exc}; still serving the previous certificate",
        )
        return
    logs.event("tls_reloaded", cert=settings.tls_cert, key=settings.tls_key)


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


_SUPERVISOR_CHECK_S = 0.5


def _watch_supervisor(pid: int, stop: asyncio.Event) -> None:
    """A worker whose supervisor is gone (its parent is now another process) stops as on
    SIGTERM: nobody would pass it a signal again."""
    loop = asyncio.get_running_loop()

    def check() -> None:
        if os.getppid() != pid:
            logs.event("supervisor_gone", logging.ERROR, supervisor=pid)
            stop.set()
            return
        loop.call_later(_SUPERVISOR_CHECK_S, check)

    check()


async def serve(
    settings: Settings,
    policies: PolicySet,
    clients: Clients | None,
    *,
    tls: ssl.SSLContext | None = None,
    reuse_port: bool = False,
) -> None:
    """Serve until SIGTERM or SIGINT; HTTPS with `tls` (`serving_tls`), reloaded on SIGHUP.
    `reuse_port`: one of several workers on one port."""
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
    loop.add_signal_handler(signal.SIGHUP, reload_tls, tls, settings)
    # A worker starts with SIGHUP, SIGTERM and SIGINT blocked (gateway.server.workers): one
    # sent meanwhile is handled now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if supervisor:
        _watch_supervisor(int(supervisor), stop)
    site = GatewaySite(
        runner,
        settings.host,
        settings.port,
        handshake_timeout_s=settings.header_timeout_s,
        ssl_context=tls,
        backlog=LISTEN_BACKLOG,
        reuse_address=True,
        reuse_port=reuse_port or None,
    )
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"cannot listen on {settings.host}:{settings.port}: {exc}") from exc
    # Everything made to start (modules, the app, the policies, the store's and the pools'
    # objects) lives as long as the process: out of the collector's sight, a full collection
    # looks only at what calls made since, instead of pausing every call in progress while it
    # walks the whole heap (the bench's p99 at 32 connections: about half).
    gc.freeze()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    logs.event(
        "serving",
        host=settings.host,
        port=settings.port,
        scheme="https" if tls else "http",
        instance=app[appkeys.STORE].instance,
        database=without_password(settings.database_url),
        upstreams=",".join(sorted(policies.upstreams)),
    )
    await stop.wait()
    logs.event("stopping", detail=f"draining calls for up to {settings.shutdown_grace_s}s")
    await runner.cleanup()  # stops accepting, lets handlers finish, then closes the store
    logs.event("stopped")
