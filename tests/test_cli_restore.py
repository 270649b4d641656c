"""`fence-gateway backup`, `restore` and `restore --floor-only` as commands (docs/contract.md
§18), called in process (`gateway.cli.main.main`) on real SQLite files and a real PostgreSQL
database: what they print, what they refuse (one line, exit 2, nothing changed), and the
PostgreSQL way back, `pg_dump` and `pg_restore` followed by `restore --floor-only`, run with
the real binaries. The story with a serving gateway is tests/e2e/test_restore_e2e.py's.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from gateway.cli.main import main
from gateway.store import create_store
from gateway.store.base import Admitted, Refused
from gateway.store.sqlite import SCHEMA_VERSION
from tests.harness import make_policy, write_policy
from tests.pg import create_database, drop_database, run_sync, url_of
from tests.store.test_contract import call

GAP = 1000


@pytest.fixture
def environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """GATEWAY_* for a SQLite store in tmp_path and a policy with an external rule; the
    database's path."""
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no .env of the repository's working folder
    policy = make_policy(
        "http://127.0.0.1:9/api",
        [
            {"match": "g/*", "lease": {"issuer": "gateway"}},
            {"match": "ext/**", "lease": {"issuer": "external"}},
        ],
    )
    monkeypatch.setenv("GATEWAY_POLICIES", str(write_policy(tmp_path / "policy.yaml", policy)))
    monkeypatch.setenv("GATEWAY_DATABASE_URL", f"sqlite:///{tmp_path}/gw.db")
    monkeypatch.setenv("GATEWAY_RESTORE_FENCE_GAP", str(GAP))
    return tmp_path / "gw.db"


async def fill(url: str) -> None:
    """A lease on g/1 (fence 1), a pending call on it, and external token 7 on ext/a/1."""
    store = create_store(url, instance="fill", durability="strict")
    await store.open()
    try:
        await store.acquire("g/1", "worker-a", 30, 0, None, None)
        assert isinstance(await store.admit(call(1, resource="g/1", issuer="gateway")), Admitted)
        assert isinstance(await store.admit(call(7, resource="ext/a/1", key="e")), Admitted)
    finally:
        await store.close()


async def probe(url: str) -> tuple[str, str, int]:
    """After a restore: (g/1 fence 1, ext/a/1 token 10**9, the next acquire of g/1)."""
    store = create_store(url, instance="probe", durability="strict")
    await store.open()
    try:
        gateway = await store.admit(call(1, resource="g/1", issuer="gateway", key="p1"))
        external = await store.admit(call(10**9, resource="ext/a/1", key="p2"))
        taken = await store.acquire("g/1", "worker-b", 30, 0, None, None)
    finally:
        await store.close()
    assert isinstance(gateway, Refused) and isinstance(external, Refused)
    return gateway.code, external.code, taken.lease.fence


def failed(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Exit 2 with one line on stderr; that line."""
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


class TestSqlite:
    def test_backup_then_restore_over_a_lost_database(
        self, environ: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
    ) -> None:
        run_sync(fill, f"sqlite:///{environ}")
        assert main(["backup", str(tmp_path / "b.db")]) == 0
        assert "1 resources" not in capsys.readouterr().out  # two: g/1 and ext/a/1
        for leftover in tmp_path.glob("gw.db*"):  # the disk is lost
            leftover.unlink()
        assert main(["restore", str(tmp_path / "b.db")]) == 0
        out = capsys.readouterr().out
        assert f"fence floor {7 + GAP} (highest fence 7 + gap {GAP}); restore epoch 1" in out
        assert "1 held leases expired; 2 pending receipts are now outcome_unknown (tool: 2)" in out
        assert "match ext/**  (upstream tool)" in out and "  ext/a/1\n" in out
        assert run_sync(probe, f"sqlite:///{environ}") == ("stale_fence", "stale_fence", 7 + GAP)
        assert not list(tmp_path.glob(".gw.db.restore-*")), "the scratch copy was left behind"

    def test_floor_only_on_the_database_as_it_is(
        self, environ: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        run_sync(fill, f"sqlite:///{environ}")
        assert main(["restore", "--floor-only"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"applied the fence floor to {environ}")
        assert run_sync(probe, f"sqlite:///{environ}") == ("stale_fence", "stale_fence", 7 + GAP)

    def test_refusals_change_nothing(
        self, environ: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
    ) -> None:
        assert "no such database" in failed(capsys, "backup", str(tmp_path / "b.db"))
        run_sync(fill, f"sqlite:///{environ}")
        before = environ.read_bytes()
        junk = tmp_path / "junk.db"
        junk.write_bytes(b"not a database " * 1000)
        assert "junk.db cannot be read" in failed(capsys, "restore", str(junk))
        assert "no such backup file" in failed(capsys, "restore", str(tmp_path / "none.db"))
        assert "backup file, or --floor-only" in failed(capsys, "restore")
        assert "is the database itself" in failed(capsys, "backup", str(environ))
        assert "is a folder" in failed(capsys, "backup", str(tmp_path))
        assert environ.read_bytes() == before

    def test_the_gap_setting_is_checked(
        self, environ: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("GATEWAY_RESTORE_FENCE_GAP", "0")
        assert "GATEWAY_RESTORE_FENCE_GAP" in failed(capsys, "restore", "--floor-only")

    def test_a_locked_database_is_not_restored(
        self, environ: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
    ) -> None:
        from gateway.store.sqlite import lock_database

        run_sync(fill, f"sqlite:///{environ}")
        assert main(["backup", str(tmp_path / "b.db")]) == 0
        lock = lock_database(environ)  # what a serving gateway holds
        try:
            before = environ.read_bytes()
            assert "locked by a running gateway" in failed(
                capsys, "restore", str(tmp_path / "b.db")
            )
            assert "locked by a running gateway" in failed(capsys, "restore", "--floor-only")
            assert environ.read_bytes() == before
        finally:
            os.close(lock)


class TestPostgres:
    def test_backup_and_plain_restore_name_the_documented_way(
        self, environ: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("GATEWAY_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
        err = failed(capsys, "backup", "b.db")
        assert "pg_dump" in err and "docs/operations/backup-restore.md" in err
        err = failed(capsys, "restore", "b.db")
        assert "pg_restore" in err and "--floor-only" in err

    @pytest.mark.skipif(
        shutil.which("pg_dump") is None and not Path("/usr/lib/postgresql/15/bin").is_dir(),
        reason="the PostgreSQL client programs are not installed",
    )
    def test_pg_dump_pg_restore_then_floor_only(
        self,
        environ: Path,
        capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
    ) -> None:
        """The documented way, as docs/operations/backup-restore.md writes it: dump, lose the
        database, restore the dump into a new one, `fence-gateway restore --floor-only`."""
        source, target = create_database(), create_database()
        try:
            run_sync(fill, url_of(source))
            dump = tmp_path / "fences.dump"
            pg_bin = _pg_bin()
            subprocess.run(
                [f"{pg_bin}pg_dump", "--format=custom", f"--file={dump}", url_of(source)],
                check=True,
                timeout=60,
            )
            subprocess.run(
                [f"{pg_bin}pg_restore", "--no-owner", f"--dbname={url_of(target)}", str(dump)],
                check=True,
                timeout=60,
            )
            monkeypatch.setenv("GATEWAY_DATABASE_URL", url_of(target))
            assert main(["restore", "--floor-only"]) == 0
            out = capsys.readouterr().out
            assert out.startswith("applied the fence floor to the PostgreSQL store at 127.0.0.1")
            assert "postgres@" not in out
            assert f"fence floor {7 + GAP}" in out and "  ext/a/1\n" in out
            assert "2 pending receipts are now outcome_unknown (tool: 2)" in out
            assert run_sync(probe, url_of(target)) == ("stale_fence", "stale_fence", 7 + GAP)
        finally:
            drop_database(source)
            drop_database(target)


def _pg_bin() -> str:
    """Where pg_dump is: on PATH, or PostgreSQL 15's Debian folder."""
    if shutil.which("pg_dump"):
        return ""
    return "/usr/lib/postgresql/15/bin/"


class TestFloorOnlyNewerSchema:
    def test_a_database_of_a_newer_gateway_is_refused_in_one_line_and_left_alone(
        self, environ: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A database a newer gateway wrote is refused by `restore --floor-only` as by a
        start (docs/operations/schema-upgrades.md): one line on stderr, exit 2, and the file
        as it was (not even switched to WAL), never a traceback."""
        with sqlite3.connect(environ) as conn:
            conn.execute("CREATE TABLE fences (resource TEXT PRIMARY KEY)")
            conn.execute("CREATE TABLE leases (resource TEXT PRIMARY KEY)")
            conn.execute("CREATE TABLE receipts (id TEXT PRIMARY KEY)")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
        conn.close()
        before = environ.read_bytes()
        try:
            code = main(["restore", "--floor-only"])
        except Exception as exc:  # what the operator sees: a traceback
            pytest.fail(f"restore --floor-only raised {type(exc).__name__}: {exc}")
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "newer than this gateway knows" in err
        assert environ.read_bytes() == before, "the refused database was changed"
