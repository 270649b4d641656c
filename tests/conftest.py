"""Shared fixtures: a recording upstream, the gateway in process (`make_app`) or as a
subprocess (`gateway_factory`), and an HTTP client."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.config.clients import load_clients
from gateway.config.policy_files import load_policies
from gateway.config.settings import Settings
from gateway.server.app import create_app
from tests.harness import (
    AppFactory,
    GatewayFactory,
    GatewayProcess,
    InProcessGateway,
    RecordingUpstream,
    write_policy,
)


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    """A real aiohttp server on 127.0.0.1 that records every request it receives."""
    async with RecordingUpstream() as server:
        yield server


@pytest.fixture
async def make_app(tmp_path: Path, upstream: RecordingUpstream, aiohttp_client: Any) -> AppFactory:
    """Build the real app in process on a policy; it is shut down (store closed, sweeper
    stopped) at teardown.

    `gw = await make_app(policy, clients=None, environ=None, **settings)`:

    * `policy`: a policy document (a dict, written to a file) or the path of one;
    * `clients`: the clients file, as its YAML text or its path (`GATEWAY_CLIENTS`);
    * `environ`: what `${NAME}` and `hmac_secret_env` resolve against (default: os.environ);
    * `settings`: `Settings` fields, over these defaults: the database
      `sqlite:///{tmp_path}/gw.db`, `instance_id="test-1"`, `sweep_interval_s=0.1`.

    Apps of one test share `tmp_path`'s database unless given their own `database_url`.
    Returns an `InProcessGateway`: `.client`, `.app`, `.store`, `.upstream`, `.url`, ...
    """
    made = 0

    async def make(
        policy: Mapping[str, Any] | Path,
        *,
        clients: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        **settings: Any,
    ) -> InProcessGateway:
        nonlocal made
        made += 1
        workdir = tmp_path / f"app{made}"
        workdir.mkdir()
        policy_path = (
            policy if isinstance(policy, Path) else write_policy(workdir / "policies.yaml", policy)
        )
        options: dict[str, Any] = {
            "database_url": f"sqlite:///{tmp_path}/gw.db",
            "policies": str(policy_path),
            "instance_id": "test-1",
            "sweep_interval_s": 0.1,
        }
        client_set = None
        if clients is not None:
            if not isinstance(clients, Path):
                (workdir / "clients.yaml").write_text(clients)
                clients = workdir / "clients.yaml"
            options["clients"] = str(clients)
            client_set = load_clients(clients)
        options.update(settings)
        app = create_app(
            Settings(_env_file=None, **options),
            load_policies(policy_path, None if environ is None else dict(environ)),
            client_set,
        )
        return InProcessGateway(await aiohttp_client(app), upstream)

    return make


HTTP_PARSERS = ("c", "python")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "both_parsers: run against gateway subprocesses on aiohttp's C HTTP parser and on its "
        "pure-Python one (AIOHTTP_NO_EXTENSIONS=1)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A `both_parsers` test that starts gateways runs once per HTTP parser."""
    marked = metafunc.definition.get_closest_marker("both_parsers") is not None
    if marked and "http_parser" in metafunc.fixturenames:
        metafunc.parametrize("http_parser", HTTP_PARSERS, indirect=True)


@pytest.fixture(scope="session")
def http_parser(request: pytest.FixtureRequest) -> str:
    """The HTTP parser of the gateway subprocesses: aiohttp's C extension ("c", the default)
    or, for `both_parsers` tests, also its pure-Python parser ("python"), where most of its
    request-smuggling bugs were."""
    return str(getattr(request, "param", "c"))


@pytest.fixture
async def gateway_factory(tmp_path: Path, http_parser: str) -> AsyncIterator[GatewayFactory]:
    """Start `python -m gateway serve` on a policy dict; every process is killed on teardown.

    `await gateway_factory(policy, extra_env={...}, sweep_interval_s=0.2)`; the processes run
    on the parser `http_parser` names.
    """
    started: list[GatewayProcess] = []
    # aiohttp reads the variable as a flag: empty is off, whatever the test runner has set
    parser_env = {"AIOHTTP_NO_EXTENSIONS": "1" if http_parser == "python" else ""}

    async def factory(
        policy: Mapping[str, Any],
        *,
        extra_env: Mapping[str, str] | None = None,
        sweep_interval_s: float = 0.2,
        tls: ssl.SSLContext | None = None,
    ) -> GatewayProcess:
        workdir = tmp_path / f"gw{len(started)}"
        workdir.mkdir()
        policy_path = write_policy(workdir / "policies.yaml", policy)
        gateway = GatewayProcess(
            workdir,
            policy_path,
            sweep_interval_s=sweep_interval_s,
            extra_env={**parser_env, **(extra_env or {})},
            tls=tls,
        )
        started.append(gateway)
        return await gateway.start()

    yield factory
    for gateway in started:
        gateway.kill9_sync()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client with no connection limit (concurrency tests open many calls at once)."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        yield client
