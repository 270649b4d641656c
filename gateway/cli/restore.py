"""`fence-gateway backup PATH` and `fence-gateway restore PATH | --floor-only`
(docs/contract.md §18): the store as files, and the way back that never reuses a fence.

Both read the store from `GATEWAY_DATABASE_URL`, like `serve`. `restore` also reads the
policies (`GATEWAY_POLICIES`) to name what stays on hold: the rules whose leases an external
service issues, and the known resources they cover. Bad arguments or configuration, a
gateway still serving the database, or a backup that cannot be used: one line on stderr and
exit 2, with nothing changed.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from gateway.store.base import RestoreReport

if TYPE_CHECKING:
    from gateway.config.policy import PolicySet
    from gateway.config.settings import Settings

EXIT_CONFIG = 2
BACKUP_PAGE = "docs/operations/backup-restore.md"
_LISTED_MAX = 50  # known external resources printed by name; more are counted
_Parser = TypeVar("_Parser", bound=argparse.ArgumentParser)


class RestoreFailed(Exception):
    """One line for stderr; exit 2."""


def add_commands(commands: argparse._SubParsersAction[_Parser]) -> None:
    backup = commands.add_parser(
        "backup", help="copy the SQLite store while the gateway serves (GATEWAY_DATABASE_URL)"
    )
    backup.add_argument("path", help="the backup file to write (replaced whole if it exists)")
    restore = commands.add_parser(
        "restore",
        help="install a backup as the store (gateway stopped), with a fence floor above it",
    )
    restore.add_argument("path", nargs="?", help="the backup file (SQLite)")
    restore.add_argument(
        "--floor-only",
        action="store_true",
        help="only apply the floor, expiries and holds to the store as it is "
        "(PostgreSQL after pg_restore; SQLite restored by other means)",
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    """`settings` are the caller's (cli.main reads them); prints what was done."""
    url = settings.database_url
    sqlite = url.startswith("sqlite:///")
    if args.command == "backup":
        if not sqlite:
            raise RestoreFailed(
                f"backup copies SQLite stores; back up PostgreSQL with pg_dump (see {BACKUP_PAGE})"
            )
        return _backup(url, Path(args.path))
    if args.floor_only == (args.path is not None):
        raise RestoreFailed("restore takes a backup file, or --floor-only (not both)")
    if not sqlite and not args.floor_only:
        raise RestoreFailed(
            "on PostgreSQL, restore the dump with pg_restore, then run "
            f"`fence-gateway restore --floor-only` (see {BACKUP_PAGE})"
        )
    from gateway.config.policy_files import PolicyError, load_policies

    try:
        policies = load_policies(settings.policies)
    except PolicyError as exc:
        raise RestoreFailed(str(exc)) from None
    gap = settings.restore_fence_gap
    if not sqlite:
        report, resources = asyncio.run(_floor_only_postgres(settings))
        print(f"applied the fence floor to the PostgreSQL store at {_where(url)}")
    elif args.floor_only:
        report, resources = _floor_only_sqlite(url, gap)
        print(f"applied the fence floor to {_sqlite_path(url)}")
    else:
        report, resources = _restore_sqlite(url, Path(args.path), gap)
    _print_report(report, gap, policies, resources)
    return 0


def _sqlite_path(url: str) -> Path:
    from gateway.store.sqlite import sqlite_path

    return sqlite_path(url)


def _where(url: str) -> str:
    """The database's host and name, never its password."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path}"


def _backup(url: str, target: Path) -> int:
    from gateway.store.sqlite_backup import BackupError, backup

    database = _sqlite_path(url)
    try:
        made = backup(database, target)
    except BackupError as exc:
        raise RestoreFailed(str(exc)) from None
    print(
        f"backed up {database} to {target}: {made.resources} resources, highest fence "
        f"{made.highest_fence}, {made.receipts} receipts (schema version {made.schema_version})"
    )
    return 0


def _restore_sqlite(url: str, backup_path: Path, gap: int) -> tuple[RestoreReport, list[str]]:
    from gateway.store.sqlite import StoreLocked
    from gateway.store.sqlite_backup import BackupError, restore

    database = _sqlite_path(url)
    try:
        restored = restore(backup_path, database, gap)
    except StoreLocked:
        raise RestoreFailed(
            f"{database} is locked by a running gateway: stop it, then restore"
        ) from None
    except BackupError as exc:
        raise RestoreFailed(str(exc)) from None
    made = restored.backup
    print(
        f"restored {database} from {backup_path}: {made.resources} resources, highest fence "
        f"{made.highest_fence}, {made.receipts} receipts"
    )
    if restored.replaced_highest is not None:
        print(f"the database it replaced had fences up to {restored.replaced_highest}")
    return restored.report, restored.resources


def _floor_only_sqlite(url: str, gap: int) -> tuple[RestoreReport, list[str]]:
    from gateway.store.sqlite import StoreLocked
    from gateway.store.sqlite_backup import BackupError, apply_in_place

    database = _sqlite_path(url)
    try:
        return apply_in_place(database, gap)
    except StoreLocked:
        raise RestoreFailed(f"{database} is locked by a running gateway: stop it first") from None
    except BackupError as exc:
        raise RestoreFailed(str(exc)) from None


async def _floor_only_postgres(settings: Settings) -> tuple[RestoreReport, list[str]]:
    from gateway.store import create_store
    from gateway.store.base import StoreUnavailable
    from gateway.store.postgres import PostgresStartupError

    store = create_store(
        settings.database_url,
        instance=f"{settings.instance_id}.restore",
        durability=settings.durability,
    )
    try:
        await store.open()
    except (StoreUnavailable, PostgresStartupError) as exc:
        raise RestoreFailed(str(exc)) from None
    try:
        report = await store.apply_restore(settings.restore_fence_gap)
        return report, await store.known_resources()
    except StoreUnavailable as exc:
        raise RestoreFailed(str(exc)) from None
    finally:
        await store.close()


def external_rules(policies: PolicySet) -> list[tuple[str, str]]:
    """(match, upstream) of every rule whose leases an external service issues."""
    return [(r.match, r.upstream) for r in policies.rules if r.lease.issuer == "external"]


def external_resources(policies: PolicySet, resources: list[str]) -> list[str]:
    """The known resources some upstream's rule for them (its first match) says are external."""
    return [
        resource
        for resource in resources
        if any(
            (rule := policies.rule_for(upstream, resource)) is not None
            and rule.lease.issuer == "external"
            for upstream in policies.upstreams
        )
    ]


def _print_report(
    report: RestoreReport, gap: int, policies: PolicySet, resources: list[str]
) -> None:
    unknown = sum(report.receipts_unknown.values())
    by_upstream = ", ".join(f"{u}: {n}" for u, n in sorted(report.receipts_unknown.items()))
    print(
        f"fence floor {report.floor} (highest fence {report.highest} + gap {gap}); "
        f"restore epoch {report.epoch}"
    )
    print(
        f"{report.leases_expired} held leases expired; {unknown} pending receipts are now "
        f"outcome_unknown{f' ({by_upstream})' if by_upstream else ''}"
    )
    rules = external_rules(policies)
    external = external_resources(policies, resources)
    if not rules and not external:
        print("no rule has an external issuer: nothing is on hold")
        return
    print(
        "\nOn hold (409 stale_fence) until raised to their issuer's current token: every "
        "resource\nof the rules whose leases an external service issues, known or not:"
    )
    for match, upstream in rules:
        print(f"  match {match}  (upstream {upstream})")
    print(f"known external resources: {len(external)}")
    for resource in external[:_LISTED_MAX]:
        print(f"  {resource}")
    if len(external) > _LISTED_MAX:
        print(f"  … and {len(external) - _LISTED_MAX} more")
    example = rules[0][0] if rules else external[0]
    print(f"\nonce the gateway runs: fence-gateway fences raise '{example}' --to N")
