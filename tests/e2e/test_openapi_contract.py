"""The OpenAPI document holds against the live gateway: `schemathesis run --checks all` on a
real gateway process reports nothing, open and with a clients file (once with a reconciler's
key, once with an admin's).

schemathesis sends what each schema admits and expects it served, sends what it does not
admit and expects it refused, probes undeclared methods, missing and wrong credentials, and
checks every answer against the document. The runs here use a fixed seed and a few examples
per operation, so that the suite stays quick and a failure is reproducible with the command it
prints; a longer run is `schemathesis run --checks all <gateway>/_gateway/v1/openapi.json`.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from pathlib import Path

from tests.harness import GatewayFactory, GatewayProcess

SEED = "20261130"
KEYS = {"reconciler": "contract-reconciler-key", "admin": "contract-admin-key"}

# A catch-all rule issuing leases, so that acquires of whatever resource schemathesis makes up
# reach the store instead of stopping at 403 resource_not_allowed.
POLICY = {
    "upstreams": [{"name": "tool", "url": "http://127.0.0.1:9/api", "mount": "/tool"}],
    "resources": [
        {
            "match": "**",
            "upstream": "tool",
            "lease": {"issuer": "gateway", "ttl_s": 30, "max_ttl_s": 300},
            "probe": {"method": "GET", "path": "/operations/{idempotency_key}"},
        }
    ],
}


# A checkpoint without X-Fence-Token is `428 missing_fence`, as a fenced call is
# (docs/contract.md §3, §17): 428 Precondition Required is among what a missing required
# header may get.
CONFIG = """
[checks.missing_required_header]
expected-statuses = [400, 401, 403, 406, 415, 422, 428]
"""


def clients_file(path: Path) -> Path:
    lines = ["clients:"]
    for role, key in KEYS.items():
        digest = hashlib.sha256(key.encode()).hexdigest()
        lines.append(f"  - {{name: contract-{role}, key_sha256: '{digest}', roles: [{role}]}}")
    path.write_text("\n".join(lines) + "\n")
    return path


async def schemathesis(
    workdir: Path, gateway: GatewayProcess, examples: int, *options: str, key: str | None = None
) -> tuple[int, str]:
    """One `schemathesis run --checks all` against the gateway's own document."""
    workdir.mkdir()
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG)
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "run",
        "--checks",
        "all",
        "--max-examples",
        str(examples),
        "--seed",
        SEED,
        "--generation-database",
        "none",
        "--no-color",
        "--request-timeout",
        "10",
    ]
    if key is not None:
        command += ["--header", f"Authorization: Bearer {key}"]
    command += options
    command.append(f"{gateway.url}/_gateway/v1/openapi.json")
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=workdir,  # schemathesis leaves its own files where it runs
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, output.decode(errors="replace")


async def test_schemathesis_finds_nothing_open_or_with_a_clients_file(
    tmp_path: Path, gateway_factory: GatewayFactory
) -> None:
    open_gateway = await gateway_factory(POLICY)
    secured = await gateway_factory(
        POLICY, extra_env={"GATEWAY_CLIENTS": str(clients_file(tmp_path / "clients.yaml"))}
    )
    # Each key on what its role is for (docs/contract.md §10): the reconciler on the receipt
    # API, the admin on the rest; the open run takes everything.
    receipt_api = "^/_gateway/v1/(receipts|reconciliation)"
    runs = {
        "open": schemathesis(tmp_path / "open", open_gateway, 5),
        "reconciler": schemathesis(
            tmp_path / "rec", secured, 3, "--include-path-regex", receipt_api,
            key=KEYS["reconciler"],
        ),
        "admin": schemathesis(
            tmp_path / "admin", secured, 3, "--exclude-path-regex", receipt_api,
            key=KEYS["admin"],
        ),
    }  # fmt: skip
    results = dict(zip(runs, await asyncio.gather(*runs.values()), strict=True))
    failed = {name: output for name, (code, output) in results.items() if code != 0}
    assert not failed, "\n\n".join(f"--- {name} ---\n{out[-6000:]}" for name, out in failed.items())
    for _name, (_code, output) in results.items():
        assert " passed" in output and "failures" not in output.lower(), output[-3000:]
