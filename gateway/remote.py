"""`leases` and `receipts` commands: talk to a running gateway's API (SPEC 12)."""

from __future__ import annotations

import argparse


def add_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Registered by the CLI; filled in by the remote commands."""


def run(args: argparse.Namespace) -> int:
    raise SystemExit(2)
