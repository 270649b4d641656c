"""The command line (docs/contract.md §12).

Bad arguments or configuration: one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from pydantic import ValidationError

if TYPE_CHECKING:
    from gateway.config.settings import Settings

EXIT_CONFIG = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SystemExit(_fail(message))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fence-gateway", description="A fencing reverse proxy for side-effecting tools."
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    serve = commands.add_parser(
        "serve", help="serve the gateway (configured by GATEWAY_* variables)"
    )
    serve.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="N processes on one port, each a replica (GATEWAY_WORKERS; PostgreSQL only)",
    )
    # One of the processes `--workers` starts: it shares the port with its siblings.
    serve.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    check = commands.add_parser("check-policies", help="validate policy files and exit")
    check.add_argument(
        "path", nargs="?", help="a YAML file or folder (default: GATEWAY_POLICIES or ./policies)"
    )
    commands.add_parser("hash-key", help="read a client secret on stdin, print its sha256")
    demo = commands.add_parser("demo", help="play the two-worker race live, with its evidence")
    demo.add_argument(
        "--browser",
        action="store_true",
        help="the race over a real Chromium driven over CDP (needs Chromium installed)",
    )
    from gateway.cli import fences, remote, restore

    remote.add_commands(commands)
    fences.add_commands(commands)
    restore.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args.workers, args.worker)
        if args.command == "check-policies":
            return _check_policies(args.path)
        if args.command == "hash-key":
            return _hash_key()
        if args.command == "demo" and args.browser:
            from gateway.cli import demo_browser

            return demo_browser.main()
        if args.command == "demo":
            from gateway.cli import demo

            return demo.main()
        if args.command in ("backup", "restore"):
            return _restore(args)
        from gateway.cli import remote

        return remote.run(args)
    except KeyboardInterrupt:
        return 130


def _fail(message: str) -> int:
    from gateway.observe import logs

    # What was logged before the failure goes first: the log writer thread would otherwise
    # write it after this line, at exit (a warning read as if it came after the reason).
    logs.flush()
    print(f"fence-gateway: {message}", file=sys.stderr)
    return EXIT_CONFIG


def _settings(workers: int | None = None) -> Settings:
    """The settings; `workers` from the command line overrides GATEWAY_WORKERS."""
    from gateway.config.settings import Settings

    try:
        return Settings() if workers is None else Settings(workers=workers)
    except ValidationError as exc:
        error = exc.errors()[0]
        if not error["loc"]:  # a check across settings: its message names them
            raise _Abort(error["msg"].removeprefix("Value error, ")) from None
        name = "GATEWAY_" + "_".join(str(p) for p in error["loc"]).upper()
        raise _Abort(f"{name}: {error['msg']}") from None


class _Abort(Exception):
    pass


def _serve(workers: int | None, worker: bool) -> int:
    from gateway.proxy.upstream import require_no_resend_switch

    # First, and before the server's modules are imported: they need a newer aiohttp still.
    try:
        require_no_resend_switch()
    except RuntimeError as exc:
        return _fail(str(exc))
    from gateway.config.clients import load_clients
    from gateway.config.policy_files import PolicyError, load_policies
    from gateway.observe import logs
    from gateway.server import eventloop
    from gateway.server.serve import (
        ConfigError,
        check_open_bind,
        check_tracing,
        serve,
        serving_tls,
    )
    from gateway.server.workers import WorkersError, check_workers, supervise

    try:
        settings = _settings(workers)
        logs.configure(settings.log_format, settings.log_level)
        check_workers(settings)
        check_tracing(settings)
        warnings: list[str] = []
        policies = load_policies(settings.policies, warnings=warnings)
        for warning in warnings:
            logs.event("policy_warning", 30, detail=warning)
        clients = load_clients(settings.clients) if settings.clients else None
        check_open_bind(settings)
        tls = serving_tls(settings)  # each worker reads the files too: it serves with them
        if settings.workers > 1 and not worker:
            return supervise(settings)
        eventloop.run(serve(settings, policies, clients, tls=tls, reuse_port=worker))
    except (_Abort, PolicyError, ConfigError, WorkersError) as exc:
        return _fail(str(exc))
    return 0


def _restore(args: argparse.Namespace) -> int:
    from gateway.cli import restore

    try:
        return restore.run(args, _settings())
    except (_Abort, restore.RestoreFailed) as exc:
        return _fail(str(exc))


def _check_policies(path: str | None) -> int:
    from gateway.config.policy_files import PolicyError, load_policies

    try:
        target = path or _settings().policies
        warnings: list[str] = []
        policies = load_policies(target, warnings=warnings)
    except (_Abort, PolicyError) as exc:
        return _fail(str(exc))
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"ok: {len(policies.upstreams)} upstreams, {len(policies.rules)} resource rules in {target}"
    )
    return 0


def _hash_key() -> int:
    secret = sys.stdin.read().strip()
    if not secret:
        return _fail("hash-key reads the secret from standard input; it was empty")
    print(hashlib.sha256(secret.encode()).hexdigest())
    return 0
