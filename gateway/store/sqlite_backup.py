"""Backing up and restoring a SQLite store (docs/contract.md §18), as files.

**Backup** copies the database with SQLite's online backup API in one step: one read
transaction, so the copy is a consistent snapshot while the gateway goes on writing (WAL lets
a reader and the writer run side by side; the gateway's flock is no SQLite lock and does not
stand in the way). The copy is written beside its target, checked, synced and renamed into
place, so a backup file is whole or absent.

**Restore** never replaces a database a gateway serves: it takes the same flock first. It
prepares the backup in a scratch copy (the schema migrated, the fence floor, the restore
epoch, the held leases expired and the `pending` receipts turned `outcome_unknown`:
`gateway.store.sqlite_floors.apply_restore`), then copies that into the database with the
backup API, which writes it as one transaction of the database itself: a crash during the
restore leaves the old database as it was. The floor stands above the highest fence of the
backup and of the database it replaces, when that one can still be read.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gateway.store import sqlite_floors
from gateway.store.base import RestoreReport
from gateway.store.sqlite import SCHEMA_VERSION, SchemaTooNew, SqliteStore, lock_database

_BUSY_TIMEOUT_S = 30


class BackupError(Exception):
    """The backup or restore cannot be made; the message says why, in one line."""


@dataclass(frozen=True, slots=True)
class Summary:
    """What a store file holds, as an operator checks a backup."""

    resources: int
    highest_fence: int
    receipts: int
    schema_version: int


@dataclass(frozen=True, slots=True)
class Restored:
    backup: Summary
    replaced_highest: int | None  # the replaced database's highest fence; None: none readable
    report: RestoreReport
    resources: list[str]  # every resource the restored store knows


@contextlib.contextmanager
def _connection(path: Path) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(path, isolation_level=None, timeout=_BUSY_TIMEOUT_S)
    conn.row_factory = sqlite3.Row
    try:
        yield conn
    finally:
        conn.close()


def summary(conn: sqlite3.Connection) -> Summary:
    return Summary(
        resources=conn.execute("SELECT count(*) FROM fences").fetchone()[0],
        highest_fence=sqlite_floors.highest_fence(conn),
        receipts=conn.execute("SELECT count(*) FROM receipts").fetchone()[0],
        schema_version=conn.execute("PRAGMA user_version").fetchone()[0],
    )


def _is_store(conn: sqlite3.Connection) -> bool:
    return bool(
        conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' "
            "AND name IN ('fences', 'leases', 'receipts')"
        ).fetchone()[0]
        == 3
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    for leftover in (path, Path(f"{path}-wal"), Path(f"{path}-shm"), Path(f"{path}-journal")):
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()


def backup(database: Path, target: Path) -> Summary:
    """A consistent copy of `database` at `target` (replaced whole if it exists)."""
    if not database.is_file():
        raise BackupError(f"{database}: no such database")
    if target.is_dir():
        raise BackupError(f"{target} is a folder: name the backup file")
    if target.exists() and target.samefile(database):
        raise BackupError(f"{target} is the database itself: name another file")
    if not target.parent.is_dir():
        raise BackupError(f"{target.parent}: no such folder")
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        with _connection(database) as source, _connection(partial) as copy:
            if not _is_store(source):
                raise BackupError(f"{database} is not a fence-gateway store")
            source.backup(copy)  # pages=-1: the whole database in one read transaction
            copy.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
            checked = copy.execute("PRAGMA quick_check").fetchone()[0]
            if checked != "ok":
                raise BackupError(f"the copy of {database} does not check out: {checked}")
            made = summary(copy)
        _fsync(partial)
        os.replace(partial, target)
        _fsync(target.parent)
        return made
    except sqlite3.Error as exc:
        raise BackupError(f"cannot back up {database}: {exc}") from exc
    finally:
        _remove(partial)


def check_backup(path: Path) -> Summary:
    """The backup's summary, once it is known to be a whole store this gateway can read."""
    if not path.is_file():
        raise BackupError(f"{path}: no such backup file")
    try:
        with _connection(path) as conn:
            checked = conn.execute("PRAGMA quick_check").fetchone()[0]
            if checked != "ok":
                raise BackupError(f"{path} is damaged: {checked}")
            if not _is_store(conn):
                raise BackupError(f"{path} is not a fence-gateway store")
            found = summary(conn)
    except sqlite3.Error as exc:
        raise BackupError(f"{path} cannot be read as a SQLite database: {exc}") from exc
    if found.schema_version > SCHEMA_VERSION:
        raise BackupError(
            f"{path} has schema version {found.schema_version}, newer than this gateway knows "
            f"({SCHEMA_VERSION}): restore it with the gateway that wrote it"
        )
    return found


def _replaced_highest(database: Path) -> int | None:
    """The highest fence of the database being replaced, or None when there is none."""
    if not database.exists() or database.stat().st_size == 0:
        return None
    try:
        with _connection(database) as conn:
            return sqlite_floors.highest_fence(conn) if _is_store(conn) else None
    except sqlite3.Error as exc:
        raise BackupError(
            f"{database} exists but cannot be read ({exc}): move it (and its -wal and -shm "
            "files) away, then restore again"
        ) from exc


def restore(backup_path: Path, database: Path, gap: int) -> Restored:
    """Install `backup_path` as the store at `database` with the fence floor (see the module
    doc). Raises `StoreLocked` when a gateway serves the database."""
    found = check_backup(backup_path)
    try:
        database.parent.mkdir(parents=True, exist_ok=True)
        lock = lock_database(database)
    except OSError as exc:
        raise BackupError(
            f"{database}: cannot be written as the database: {exc.strerror or exc}"
        ) from None
    scratch = database.with_name(f".{database.name}.restore-{os.getpid()}")
    try:
        replaced = _replaced_highest(database)
        with _connection(backup_path) as source, _connection(scratch) as conn:
            source.backup(conn)
        prepared = SqliteStore(scratch, instance="restore")._connect(read_only=False)
        try:
            prepared.execute("BEGIN IMMEDIATE")
            report = sqlite_floors.apply_restore(prepared, gap, replaced or 0, time.time())
            resources = sqlite_floors.known_resources(prepared)
            prepared.execute("COMMIT")
            with _connection(database) as installed:
                installed.execute("PRAGMA synchronous=FULL")
                prepared.backup(installed)
                installed.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            prepared.close()
        return Restored(found, replaced, report, resources)
    except sqlite3.Error as exc:
        raise BackupError(f"cannot restore {database} from {backup_path}: {exc}") from exc
    finally:
        _remove(scratch)
        os.close(lock)


def apply_in_place(database: Path, gap: int) -> tuple[RestoreReport, list[str]]:
    """`restore --floor-only` on SQLite: the floor and the rest applied to the database as it
    is (restored by other means, a file system snapshot say). Raises `StoreLocked` when a
    gateway serves it."""
    if not database.is_file():
        raise BackupError(f"{database}: no such database")
    lock = lock_database(database)
    try:
        try:
            conn = SqliteStore(database, instance="restore")._connect(read_only=False)
        except SchemaTooNew as exc:  # refused before anything is written
            raise BackupError(f"{database}: {exc}") from None
        try:
            conn.execute("BEGIN IMMEDIATE")
            report = sqlite_floors.apply_restore(conn, gap, 0, time.time())
            resources = sqlite_floors.known_resources(conn)
            conn.execute("COMMIT")
        finally:
            conn.close()
        return report, resources
    except sqlite3.Error as exc:
        raise BackupError(f"cannot apply the fence floor to {database}: {exc}") from exc
    finally:
        os.close(lock)
