"""Backup, restore, and never reusing a fence (docs/contract.md §18), with real processes.

The gateway serves calls while `fence-gateway backup` copies its SQLite store; more calls
with higher fences follow; the gateway is killed with SIGKILL and the store is restored from
the backup with `fence-gateway restore`; the gateway starts again. Then every fence used after
the backup is refused (gateway-issued ones by the floor, external ones by the hold), a new
acquire issues above every fence issued before, the call in flight at the backup is in the
reconciliation queue, `fence-gateway fences raise` lets the external issuer's next token in,
and the tool never receives a call with a fence lower than one it already saw.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.cli.main import main
from tests.harness import (
    Behavior,
    GatewayFactory,
    GatewayProcess,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    make_policy,
    problem,
)

GAP = 1_000_000


def policy(upstream: RecordingUpstream) -> dict[str, Any]:
    return make_policy(
        upstream.url,
        [
            {"match": "g/*", "lease": {"issuer": "gateway", "ttl_s": 30}},
            {
                "match": "c/*",
                "lease": {"issuer": "gateway", "ttl_s": 30},
                "on_expiry": {"method": "POST", "path": "/cleanup/{name}"},
            },
            {"match": "ext/*", "lease": {"issuer": "external"}},
        ],
    )


async def cli(gateway: GatewayProcess, *args: str, env: dict[str, str] | None = None):
    """`python -m gateway ARGS` with the gateway's settings: (exit status, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        *args,
        cwd=gateway.workdir,
        env={**gateway.env(), **(env or {})},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, out.decode(), err.decode()


async def send(
    session: aiohttp.ClientSession,
    gateway: GatewayProcess,
    resource: str,
    fence: int,
    path: str = "/act",
    owner: str | None = None,
):
    return await call(
        session,
        "POST",
        f"{gateway.url}/tool{path}",
        data=os.urandom(8).hex().encode(),  # every call its own operation (derived key)
        headers=fenced_headers(resource, fence, owner=owner),
    )


async def acquire(
    session: aiohttp.ClientSession, gateway: GatewayProcess, resource: str, owner: str
):
    async with session.post(
        f"{gateway.url}/_gateway/v1/leases/{resource}", json={"owner": owner, "ttl_s": 30}
    ) as resp:
        return resp.status, await resp.json(content_type=None)


def code(result) -> str | int | None:
    """The problem's code of a refusal, or the status of an answer."""
    if result.status is not None and result.status >= 400:
        return problem(result)["code"]
    return result.status


def never_backwards(upstream: RecordingUpstream) -> None:
    """Per resource, no call reached the tool with a fence lower than one it had seen."""
    highest: dict[str | None, int] = {}
    for recorded in sorted(upstream.requests, key=lambda r: r.seq):
        fence = recorded.fence or 0
        assert fence >= highest.get(recorded.resource, 0), (
            f"{recorded.resource}: fence {fence} reached the tool after "
            f"{highest[recorded.resource]}"
        )
        highest[recorded.resource] = fence


class TestBackupAndRestore:
    async def test_every_fence_used_after_the_backup_is_refused_and_none_is_reused(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
        tmp_path: Path,
    ) -> None:
        gateway = await gateway_factory(policy(upstream))
        backup_file = tmp_path / "backup.db"

        # Before the backup: a lease on g/1 (fence 1) and c/1 (with an on_expiry cleanup),
        # external tokens up to 10, and one call that is still at the tool while the backup
        # is taken.
        assert (await acquire(session, gateway, "g/1", "worker-a"))[1]["fence"] == 1
        assert (await acquire(session, gateway, "c/1", "worker-a"))[1]["fence"] == 1
        for fence in range(1, 11):
            assert (await send(session, gateway, "ext/1", fence)).status == 200
        gate = asyncio.Event()
        upstream.script("/api/slow", Behavior(gate=gate))
        in_flight = asyncio.create_task(send(session, gateway, "g/1", 1, path="/slow"))
        await upstream.wait_received(1, path="/api/slow")

        # The backup, while calls keep flowing.
        stop = asyncio.Event()

        async def keep_calling() -> list[int | None]:
            statuses = []
            while not stop.is_set():
                statuses.append((await send(session, gateway, "ext/1", 10)).status)
            return statuses

        flowing = asyncio.create_task(keep_calling())
        status, out, err = await cli(gateway, "backup", str(backup_file))
        stop.set()
        assert status == 0, err
        assert "backed up" in out and "highest fence 10" in out
        statuses = await flowing
        assert len(statuses) > 1 and set(statuses) == {200}
        gate.set()
        assert (await in_flight).status == 200

        # After the backup: a takeover of g/1 (fence 2) and external tokens up to 50.
        async with session.delete(f"{gateway.url}/_gateway/v1/leases/g/1?force=true") as resp:
            assert resp.status == 204
        status, lease = await acquire(session, gateway, "g/1", "worker-b")
        assert (status, lease["fence"]) == (201, 2)
        assert (await send(session, gateway, "g/1", 2, owner="worker-b")).status == 200
        for fence in (20, 35, 50):
            assert (await send(session, gateway, "ext/1", fence)).status == 200
        seen_before_loss = len(upstream.requests)

        # A running gateway holds the database: restore refuses, changing nothing.
        status, _out, err = await cli(gateway, "restore", str(backup_file))
        assert status == 2 and "locked by a running gateway" in err

        await gateway.kill9()
        status, out, err = await cli(gateway, "restore", str(backup_file))
        assert status == 0, err
        # the backup knew external token 10, the database it replaced token 50
        assert f"fence floor {50 + GAP} (highest fence 50 + gap {GAP})" in out
        assert "match ext/*" in out and "  ext/1" in out  # the glob and the known resource
        await gateway.start()

        # Gateway-issued fences from before the restore, used or not: stale (under the floor).
        assert code(await send(session, gateway, "g/1", 2, owner="worker-b")) == "stale_fence"
        assert code(await send(session, gateway, "g/1", 1, owner="worker-a")) == "stale_fence"
        assert code(await send(session, gateway, "g/1", 3)) == "stale_fence"
        # External tokens: on hold, the last one used and any newer one alike.
        assert code(await send(session, gateway, "ext/1", 50)) == "stale_fence"
        assert code(await send(session, gateway, "ext/1", 10**9)) == "stale_fence"
        assert code(await send(session, gateway, "ext/new", 10**9)) == "stale_fence"
        calls_received = [r for r in upstream.requests if not r.path.startswith("/api/cleanup/")]
        assert len(calls_received) == seen_before_loss, "a refused call reached the tool"

        # A new acquire issues above every fence issued before (the held lease expired).
        status, lease = await acquire(session, gateway, "g/1", "worker-c")
        assert status == 201 and lease["fence"] >= 1 + GAP
        assert (await send(session, gateway, "g/1", lease["fence"], owner="worker-c")).status == 200

        # The calls in flight at the backup are in the reconciliation queue: the gated one,
        # and any of the flowing ones caught between admission and outcome. The tool's own
        # records, searched by idempotency key, say what became of each.
        queue = await fetch_receipts(session, gateway.url, status="outcome_unknown")
        assert ("g/1", "/slow") in [(r["resource"], r["path"]) for r in queue]
        assert {(r["resource"], r["path"], r["error"]) for r in queue} <= {
            ("g/1", "/slow", "store_restored"),
            ("ext/1", "/act", "store_restored"),
        }
        async with session.get(f"{gateway.url}/_gateway/v1/reconciliation") as resp:
            assert {r["id"] for r in (await resp.json())["items"]} == {r["id"] for r in queue}
        at_the_tool = {r.headers["Idempotency-Key"]: r.path for r in upstream.requests}
        assert {r["idempotency_key"]: at_the_tool.get(r["idempotency_key"]) for r in queue} == {
            r["idempotency_key"]: f"/api{r['path']}" for r in queue
        }

        # c/1's lease was held at the backup: the restore expired it, and its cleanup ran
        # through the fenced path with a fence above the floor.
        await upstream.wait_received(1, path="/api/cleanup/1", timeout=10)
        [cleanup] = upstream.received(path="/api/cleanup/1")
        assert cleanup.fence is not None and cleanup.fence >= 1 + GAP

        # The admin raises the external resources to the issuer's current token.
        status, out, err = await cli(
            gateway, "fences", "raise", "ext/*", "--to", "60", "--url", gateway.url
        )
        assert status == 0, err
        assert "raised ext/* to at least 60" in out
        assert code(await send(session, gateway, "ext/1", 59)) == "stale_fence"
        assert (await send(session, gateway, "ext/1", 60)).status == 200
        assert (await send(session, gateway, "ext/new", 61)).status == 200  # first seen later
        never_backwards(upstream)


class TestNemesis:
    """Cycles of calls with rising fences, a backup at a random moment, kill -9, a restore of
    an older backup, a restart and more calls, stale ones among them: not one stale admission
    reaches the tool. The commands run in this process (`gateway.cli.main.main`, the
    gateway's settings in the environment) to keep the cycles quick; the gateway is a real
    process, killed for real."""

    async def test_restoring_older_backups_never_lets_a_stale_fence_through(
        self,
        upstream: RecordingUpstream,
        gateway_factory: GatewayFactory,
        session: aiohttp.ClientSession,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        rng = random.Random(int(hashlib.sha256(b"restore-nemesis").hexdigest(), 16) % 2**32)
        gateway = await gateway_factory(policy(upstream))
        for name, value in gateway.env().items():
            if name.startswith("GATEWAY_"):
                monkeypatch.setenv(name, value)

        async def command(*args: str) -> None:
            assert await asyncio.to_thread(main, list(args)) == 0, args

        backups: list[Path] = []
        external = 0  # the external issuer's counter: it only goes up, backups or not
        refused_stale = 0
        for cycle in range(3):
            status, lease = await acquire(session, gateway, "g/n", f"worker-{cycle}")
            if status != 201:  # still held from before the last crash: take it over
                async with session.delete(f"{gateway.url}/_gateway/v1/leases/g/n?force=true"):
                    pass
                status, lease = await acquire(session, gateway, "g/n", f"worker-{cycle}")
            assert status == 201, lease
            backup_at = rng.randrange(2, 8)
            for step in range(10):
                external += rng.randrange(1, 4)
                result = await send(session, gateway, "ext/n", external)
                assert result.status == 200, (cycle, step, code(result))
                result = await send(session, gateway, "g/n", lease["fence"], owner=lease["owner"])
                assert result.status == 200, (cycle, step, code(result))
                if step == backup_at:
                    backups.append(tmp_path / f"backup-{cycle}.db")
                    await command("backup", str(backups[-1]))
            await gateway.kill9()
            if cycle < 2:
                older = rng.choice(backups)  # possibly from an earlier cycle
            else:  # the disk is lost with the database: the newest backup is all there is
                older = backups[-1]
                for leftover in gateway.workdir.glob("gw.db*"):
                    leftover.unlink()
            await command("restore", str(older))
            await gateway.start()
            # The stale ones: every fence of the lease before, every external token before.
            for fence in {1, lease["fence"], lease["fence"] + 1}:
                refused = await send(session, gateway, "g/n", fence, owner=lease["owner"])
                assert code(refused) == "stale_fence", (cycle, fence)
                refused_stale += 1
            for token in {1, external - 1, external}:
                assert code(await send(session, gateway, "ext/n", token)) == "stale_fence"
                refused_stale += 1
            # The external issuer's admin raises to its current value; it goes on from there.
            await command(
                "fences", "raise", "ext/*", "--to", str(external + 1), "--url", gateway.url
            )
            external += 1
            assert code(await send(session, gateway, "ext/n", external - 1)) == "stale_fence"
            never_backwards(upstream)
        assert refused_stale >= 3 * 4
        never_backwards(upstream)
