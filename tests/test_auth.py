"""Clients, roles and scopes (docs/contract.md §10), on the real app with a real clients
file."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.config.clients import load_clients
from gateway.config.yaml_file import ConfigFileError
from tests.harness import AppFactory, InProcessGateway, RecordingUpstream, make_policy

KEYS = {"runner": "k-runner", "other": "k-other", "recon": "k-recon", "root": "k-root"}
CLIENTS = f"""\
clients:
  - name: runner
    key_sha256: "{hashlib.sha256(b"k-runner").hexdigest()}"
    roles: [agent]
    resources: ["browser/*"]
  - name: other
    key_sha256: "{hashlib.sha256(b"k-other").hexdigest()}"
    roles: [agent]
    resources: ["browser/**"]
  - name: recon
    key_sha256: "{hashlib.sha256(b"k-recon").hexdigest()}"
    roles: [reconciler]
  - name: root
    key_sha256: "{hashlib.sha256(b"k-root").hexdigest()}"
    roles: [admin]
"""


def bearer(who: str, header: str = "Authorization") -> dict[str, str]:
    return {header: f"Bearer {KEYS[who]}"}


def proxy_auth(who: str) -> dict[str, str]:
    return bearer(who, "Proxy-Authorization")


@pytest.fixture
async def gw(make_app: AppFactory, upstream: RecordingUpstream) -> InProcessGateway:
    policy = make_policy(
        upstream.url,
        [
            {"match": "browser/*", "lease": {"issuer": "gateway", "ttl_s": 30}},
            {"match": "deploy/*", "lease": {"issuer": "gateway", "ttl_s": 30}},
        ],
    )
    return await make_app(policy, clients=CLIENTS, instance_id="t", sweep_interval_s=1)


async def status_code(response: Any) -> tuple[int, str | None]:
    async with response as r:
        body = await r.json(content_type=None) if r.status >= 400 else None
        return r.status, body and body.get("code")


async def acquire(gw: Any, who: str, resource: str = "browser/a") -> dict[str, Any]:
    async with gw.client.post(
        f"/_gateway/v1/leases/{resource}", json={"owner": who}, headers=bearer(who)
    ) as r:
        assert r.status == 201, await r.text()
        return await r.json()


def fenced(resource: str, fence: int) -> dict[str, str]:
    return {"X-Lease-Resource": resource, "X-Fence-Token": str(fence)}


class TestProxiedCalls:
    """Every proxied call names an agent by Proxy-Authorization; fenced ones stay in scope."""

    async def test_no_key_wrong_key_and_wrong_role(self, gw, upstream) -> None:
        assert await status_code(gw.client.get("/tool/x")) == (401, "unauthenticated")
        assert await status_code(
            gw.client.get("/tool/x", headers={"Proxy-Authorization": "Bearer nope"})
        ) == (401, "unauthenticated")
        assert await status_code(gw.client.get("/tool/x", headers=bearer("runner"))) == (
            401,
            "unauthenticated",
        )  # Authorization belongs to the tool on proxied calls
        assert await status_code(gw.client.get("/tool/x", headers=proxy_auth("recon"))) == (
            403,
            "forbidden",
        )
        assert upstream.received() == []

    async def test_agent_in_scope_is_forwarded_and_its_name_recorded(self, gw, upstream) -> None:
        lease = await acquire(gw, "runner")
        async with gw.client.post(
            "/tool/click",
            data=b"x",
            headers={**proxy_auth("runner"), **fenced("browser/a", lease["fence"])},
        ) as r:
            assert r.status == 200
            receipt_id = r.headers["X-Receipt-Id"]
        [seen] = upstream.received()
        assert "Proxy-Authorization" not in seen.headers
        async with gw.client.get(
            f"/_gateway/v1/receipts/{receipt_id}", headers=bearer("recon")
        ) as r:
            assert (await r.json())["client"] == "runner"

    async def test_agent_out_of_scope_is_forbidden_and_recorded(self, gw, upstream) -> None:
        assert await status_code(
            gw.client.post("/tool/x", headers={**proxy_auth("runner"), **fenced("deploy/x", 1)})
        ) == (403, "forbidden")
        assert upstream.received() == []
        async with gw.client.get("/_gateway/v1/receipts", headers=bearer("root")) as r:
            [receipt] = (await r.json())["items"]
        assert (receipt["status"], receipt["reject_code"], receipt["client"]) == (
            "rejected",
            "forbidden",
            "runner",
        )

    async def test_only_the_acquiring_client_may_use_the_fence(self, gw, upstream) -> None:
        lease = await acquire(gw, "runner")
        assert await status_code(
            gw.client.post(
                "/tool/x", headers={**proxy_auth("other"), **fenced("browser/a", lease["fence"])}
            )
        ) == (403, "not_lease_holder")
        assert upstream.received() == []

    async def test_only_the_acquiring_client_may_renew_or_release(self, gw) -> None:
        lease = await acquire(gw, "runner")
        who = {"owner": "runner", "fence": lease["fence"]}
        assert await status_code(
            gw.client.put("/_gateway/v1/leases/browser/a", json=who, headers=bearer("other"))
        ) == (409, "lease_lost")
        assert await status_code(
            gw.client.delete("/_gateway/v1/leases/browser/a", params=who, headers=bearer("other"))
        ) == (409, "lease_lost")
        assert await status_code(
            gw.client.put("/_gateway/v1/leases/browser/a", json=who, headers=bearer("runner"))
        ) == (200, None)


class TestApiRoles:
    """Reconcilers read and resolve; agents use their own leases; admins may revoke."""

    async def test_open_and_keyed_paths(self, gw) -> None:
        assert await status_code(gw.client.get("/_gateway/healthz")) == (200, None)
        assert await status_code(gw.client.get("/_gateway/metrics")) == (401, "unauthenticated")
        assert await status_code(gw.client.get("/_gateway/metrics", headers=bearer("runner"))) == (
            200,
            None,
        )
        assert await status_code(
            gw.client.get("/_gateway/v1/openapi.json", headers=proxy_auth("recon"))
        ) == (200, None)

    async def test_receipts_need_a_reconciler(self, gw) -> None:
        assert await status_code(
            gw.client.get("/_gateway/v1/receipts", headers=bearer("runner"))
        ) == (403, "forbidden")
        assert await status_code(
            gw.client.get("/_gateway/v1/reconciliation", headers=bearer("recon"))
        ) == (200, None)

    async def test_leases(self, gw) -> None:
        await acquire(gw, "runner")
        assert await status_code(
            gw.client.post(
                "/_gateway/v1/leases/deploy/x", json={"owner": "o"}, headers=bearer("runner")
            )
        ) == (403, "forbidden")
        assert await status_code(
            gw.client.post(
                "/_gateway/v1/leases/browser/b", json={"owner": "o"}, headers=bearer("recon")
            )
        ) == (403, "forbidden")
        assert await status_code(
            gw.client.get("/_gateway/v1/leases/browser/a", headers=bearer("recon"))
        ) == (200, None)
        assert await status_code(
            gw.client.get("/_gateway/v1/leases", headers=bearer("runner"))
        ) == (403, "forbidden")
        assert await status_code(
            gw.client.delete("/_gateway/v1/leases/browser/a?force=true", headers=bearer("runner"))
        ) == (403, "forbidden")
        assert await status_code(
            gw.client.delete("/_gateway/v1/leases/browser/a?force=true", headers=bearer("root"))
        ) == (204, None)


class TestClientsFile:
    def test_errors_name_file_line_and_field(self, tmp_path: Path) -> None:
        path = tmp_path / "clients.yaml"
        path.write_text("clients:\n  - name: a\n    key_sha256: nothex\n    roles: [agent]\n")
        with pytest.raises(ConfigFileError, match=r"clients\.yaml:3: clients\[0\]\.key_sha256"):
            load_clients(path)
        path.write_text(
            CLIENTS + "  - name: runner\n    key_sha256: '" + "0" * 64 + "'\n    roles: [admin]\n"
        )
        with pytest.raises(ConfigFileError, match=r"the same name as clients\[0\]"):
            load_clients(path)
        path.write_text("clients:\n  - {name: a, key_sha256: '" + "0" * 64 + "', roles: [agent]}\n")
        with pytest.raises(ConfigFileError, match="an agent needs at least one resource"):
            load_clients(path)

    def test_serve_refuses_a_bad_clients_file(self, tmp_path: Path) -> None:
        bad = tmp_path / "clients.yaml"
        bad.write_text("clients: 3\n")
        result = subprocess.run(
            [sys.executable, "-m", "gateway", "serve"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
            env={
                "PATH": "/usr/bin:/bin",
                "GATEWAY_CLIENTS": str(bad),
                "GATEWAY_POLICIES": str(Path(__file__).parents[1] / "policies"),
                "PYTHONPATH": str(Path(__file__).parents[1]),
            },
        )
        assert result.returncode == 2
        assert (
            result.stderr.strip().splitlines()[-1].startswith(f"fence-gateway: {bad}:1: clients: ")
        )


async def test_a_key_that_is_not_utf8_is_401(gw) -> None:
    reader, writer = await asyncio.open_connection(gw.host, gw.port)
    writer.write(
        b"GET /_gateway/metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n"
    )
    status_line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert status_line.split()[1] == b"401"
