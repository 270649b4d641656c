"""Checkpoints and restore at their edges (docs/contract.md §17, §18): a state is measured as
the JSON its owner sent, an identical retry is one however its numbers are written, and
`restore --floor-only` leaves a newer gateway's database alone."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.main import main
from gateway.store.sqlite import SCHEMA_VERSION
from tests.harness import (
    AppFactory,
    InProcessGateway,
    RecordingUpstream,
    make_policy,
    write_policy,
)


def _policy(upstream: RecordingUpstream) -> dict[str, Any]:
    return make_policy(
        upstream.url,
        [
            {"match": "g/*", "lease": {"issuer": "gateway", "ttl_s": 30}},
            {"match": "ext/**", "lease": {"issuer": "external"}},
        ],
    )


async def _checkpoint(gw: InProcessGateway, resource: str, fence: int, body: bytes):
    return await gw.send(
        "PUT",
        f"/_gateway/v1/checkpoints/{resource}",
        data=body,
        headers={"X-Fence-Token": str(fence), "Content-Type": "application/json"},
    )


class TestStateSize:
    async def test_state_is_measured_as_the_compact_json_sent(
        self, make_app: AppFactory, upstream: RecordingUpstream
    ) -> None:
        """§17: `state` is measured as compact JSON, at most 65536 bytes. A state of 10,000
        numbers written `1e30` is 50,001 bytes of compact JSON (60,001 as Python writes it,
        `1e+30`): it must be kept. The API's body parser turns each whole number written with
        an exponent into an int of 31 digits, so the gateway measures 320,001 bytes."""
        gw = await make_app(_policy(upstream))
        state = "[" + ",".join(["1e30"] * 10000) + "]"
        assert len(json.dumps(json.loads(state), separators=(",", ":"))) <= 65536
        body = ('{"step":"s","state":' + state + "}").encode()
        assert len(body) < 131072
        status, _h, answer = await _checkpoint(gw, "ext/a", 5, body)
        assert status == 201, answer


class TestIdenticalRetry:
    async def test_a_very_large_number_written_either_way_is_one_state(
        self, make_app: AppFactory, upstream: RecordingUpstream
    ) -> None:
        """§17: an identical retry (same fence, owner, step, `state` equal as JSON) answers
        200 and appends nothing. `1e31` and `10000000000000000000000000000000` are one JSON
        number, as `1e30` and `1000000000000000000000000000000` are (which the gateway does
        count as equal): a retry that writes it the other way must not append."""
        gw = await make_app(_policy(upstream))
        for exponent in (30, 31):
            resource = f"ext/n{exponent}"
            digits = "1" + "0" * exponent
            status, _h, first = await _checkpoint(
                gw, resource, 5, f'{{"step":"s","state":{{"n":{digits}}}}}'.encode()
            )
            assert (status, first["seq"]) == (201, 1)
            status, _h, retry = await _checkpoint(
                gw, resource, 5, f'{{"step":"s","state":{{"n":1e{exponent}}}}}'.encode()
            )
            assert (status, retry["seq"]) == (200, 1), (exponent, retry)


@pytest.fixture
def environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """GATEWAY_* for a SQLite store in tmp_path (as tests/test_cli_restore.py); its path."""
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    policy = make_policy(
        "http://127.0.0.1:9/api",
        [
            {"match": "g/*", "lease": {"issuer": "gateway"}},
            {"match": "ext/**", "lease": {"issuer": "external"}},
        ],
    )
    monkeypatch.setenv("GATEWAY_POLICIES", str(write_policy(tmp_path / "policy.yaml", policy)))
    monkeypatch.setenv("GATEWAY_DATABASE_URL", f"sqlite:///{tmp_path}/gw.db")
    monkeypatch.setenv("GATEWAY_RESTORE_FENCE_GAP", "1000")
    return tmp_path / "gw.db"


class TestFloorOnlyNewerSchema:
    def test_a_database_of_a_newer_gateway_is_refused_in_one_line_and_left_alone(
        self, environ: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """§18 / cli/restore.py: a database that cannot be used is one line on stderr and
        exit 2, with nothing changed (docs/operations/schema-upgrades.md: a newer schema is
        refused). `restore --floor-only` on a SQLite database a newer gateway wrote dies with
        a traceback instead, after switching the database to WAL."""
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
