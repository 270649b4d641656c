"""`fence-gateway serve --workers N` and the start-up checks of a replica (docs/contract.md
§14): real processes on a real port and a real database."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.harness import (
    REPO_ROOT,
    GatewayProcess,
    RecordingUpstream,
    call,
    fenced_headers,
    make_policy,
    wait_for,
    write_policy,
)
from tests.pg import run_sync, server_sql


def start_cli(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", *args],
        cwd=tmp_path,
        env={**base, "PYTHONPATH": str(REPO_ROOT), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def one_line_exit_2(tmp_path: Path, env: dict[str, str], *args: str) -> str:
    """Run `serve`, expect exit 2 with one reason line; that line."""
    proc = start_cli(tmp_path, env, *args)
    try:
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reasons = [line for line in stderr.decode().splitlines() if line.startswith("fence-gateway:")]
    assert (proc.returncode, len(reasons)) == (2, 1), stderr.decode()
    return reasons[0]


def base_env(tmp_path: Path, upstream: RecordingUpstream, database_url: str) -> dict[str, str]:
    policies = write_policy(
        tmp_path / "policies.yaml", make_policy(upstream.url, [{"match": "deploy/*"}])
    )
    return {
        "GATEWAY_POLICIES": str(policies),
        "GATEWAY_DATABASE_URL": database_url,
        "GATEWAY_SWEEP_INTERVAL_S": "0.2",
    }


class TestWorkers:
    async def test_two_workers_share_one_port_and_stop_together(
        self,
        tmp_path: Path,
        upstream: RecordingUpstream,
        pg_url: str,
        session: aiohttp.ClientSession,
    ) -> None:
        gateway = GatewayProcess(
            tmp_path,
            write_policy(tmp_path / "policies.yaml", make_policy(upstream.url, [{"match": "d/*"}])),
            extra_env={
                "GATEWAY_DATABASE_URL": pg_url,
                "GATEWAY_WORKERS": "2",
                "GATEWAY_INSTANCE_ID": "w",
            },
        )
        await gateway.start()
        assert gateway.proc is not None
        try:
            # Each new connection lands on one of the workers: both answer, as replicas (the
            # second may still be starting when the first answers).
            seen: set[str] = set()

            async def both_answered() -> bool:
                async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(force_close=True)
                ) as fresh:
                    ready = await call(fresh, "GET", f"{gateway.url}/_gateway/readyz")
                assert ready.status == 200
                seen.add(ready.json()["instance"])
                return len(seen) == 2

            await wait_for(both_answered, timeout=15, interval=0, what="both workers to answer")
            assert seen == {"w", "w.1"}
            results = [
                await call(
                    session,
                    "POST",
                    f"{gateway.url}/tool/op",
                    data=str(i).encode(),
                    headers=fenced_headers("d/1", 1 + i // 5),
                )
                for i in range(20)
            ]
            assert [r.status for r in results] == [200] * 20
            assert [r.fence for r in upstream.requests] == [1 + i // 5 for i in range(20)]
            assert await gateway.terminate() == 0
        finally:
            with contextlib.suppress(ProcessLookupError):  # the workers, should any be left
                os.killpg(gateway.proc.pid, signal.SIGKILL)
            gateway.kill9_sync()

    def test_sqlite_with_two_workers_exits_2(
        self, tmp_path: Path, upstream: RecordingUpstream
    ) -> None:
        env = base_env(tmp_path, upstream, f"sqlite:///{tmp_path}/gw.db")
        reason = one_line_exit_2(tmp_path, env | {"GATEWAY_PORT": "0"}, "--workers", "2")
        assert "GATEWAY_WORKERS=2" in reason and "SQLite" in reason


class TestStartUpChecks:
    def test_strict_durability_refuses_synchronous_commit_off(
        self, tmp_path: Path, upstream: RecordingUpstream, pg_url: str
    ) -> None:
        database = pg_url.rsplit("/", 1)[1]
        run_sync(server_sql, f"ALTER DATABASE {database} SET synchronous_commit = off")
        reason = one_line_exit_2(tmp_path, base_env(tmp_path, upstream, pg_url))
        assert "synchronous_commit" in reason

    def test_a_schema_newer_than_the_code_exits_2(
        self, tmp_path: Path, upstream: RecordingUpstream, pg_url: str
    ) -> None:
        database = pg_url.rsplit("/", 1)[1]
        for statement in (
            "CREATE TABLE schema_version (version integer PRIMARY KEY, applied_at float8)",
            "INSERT INTO schema_version VALUES (999, 0)",
        ):
            run_sync(server_sql, statement, database)
        reason = one_line_exit_2(tmp_path, base_env(tmp_path, upstream, pg_url))
        assert "newer than this gateway knows" in reason
