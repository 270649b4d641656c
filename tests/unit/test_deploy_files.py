"""The deployment files under deploy/: every YAML parses, and the invariants that keep a
deployment safe hold (docs/contract.md §9, §10, §14).

SQLite serves one process, so its manifests run exactly one replica and never overlap two;
PostgreSQL variants run two or more with rolling updates and take the database URL from a
Secret; every stop grace outlasts GATEWAY_SHUTDOWN_GRACE_S, so calls in flight finish and
their outcomes are recorded.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from gateway.config.policy_files import load_policies

SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # same rules, faster with libyaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "kubernetes"
K8S_PG = K8S / "postgres"
YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


@functools.cache
def load_all(path: Path) -> list[Any]:
    """The documents of a YAML file (parsed once per run; callers do not modify them)."""
    with path.open() as file:
        return [doc for doc in yaml.load_all(file, Loader=SafeLoader) if doc is not None]


def load(path: Path) -> Any:
    (doc,) = load_all(path)
    return doc


def seconds(value: str | int | float) -> float:
    """A compose duration ("30s", "1m30s", "500ms") or a number of seconds."""
    if isinstance(value, int | float):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 0.000001}
    return sum(float(n) * scale[u] for n, u in parts)


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def is_gateway(service: dict[str, Any]) -> bool:
    """A service that runs the gateway (the example tool runs the same image, not `serve`)."""
    return "entrypoint" not in service and any(
        k.startswith("GATEWAY_") for k in compose_env(service)
    )


def container_env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


def deployment(path: Path) -> dict[str, Any]:
    (doc,) = [d for d in load_all(path) if d.get("kind") == "Deployment"]
    return doc


def gateway_container(deploy: dict[str, Any]) -> dict[str, Any]:
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return container


def prestop_sleep(container: dict[str, Any]) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    if not command:
        return 0.0
    assert command[0] == "sleep", command
    return float(command[1])


# -- every file -------------------------------------------------------------------------------


def test_deploy_folder_has_the_expected_files() -> None:
    names = {str(p.relative_to(DEPLOY)) for p in YAML_FILES}
    assert {
        "compose.yaml",
        "compose.postgres.yaml",
        "clients.example.yaml",
        "policies-example/tool.yaml",
        "kubernetes/deployment.yaml",
        "kubernetes/kustomization.yaml",
        "kubernetes/postgres/deployment.yaml",
        "kubernetes/postgres/kustomization.yaml",
        "kubernetes/postgres/poddisruptionbudget.yaml",
        "compose.patroni.yaml",
        "patroni/patroni.yml",
        "kubernetes/patroni/kustomization.yaml",
    } <= names


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = load_all(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(doc, dict) for doc in docs)


@pytest.mark.parametrize("folder", [K8S, K8S_PG], ids=["sqlite", "postgres"])
def test_kustomizations_name_files_that_exist(folder: Path) -> None:
    kustomization = load(folder / "kustomization.yaml")
    for entry in kustomization["resources"] + [p["path"] for p in kustomization.get("patches", [])]:
        assert (folder / entry).exists(), f"{folder.name}/kustomization.yaml: {entry} is missing"


# -- SQLite: one process, never two ---------------------------------------------------------


def test_sqlite_kubernetes_runs_one_replica_with_recreate() -> None:
    deploy = deployment(K8S / "deployment.yaml")
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"]["type"] == "Recreate"
    env = container_env(gateway_container(deploy))
    assert env["GATEWAY_DATABASE_URL"]["value"].startswith("sqlite:///")
    assert "pvc.yaml" in load(K8S / "kustomization.yaml")["resources"]


def test_sqlite_compose_runs_one_replica() -> None:
    services = load(DEPLOY / "compose.yaml")["services"]
    gateways = [s for s in services.values() if is_gateway(s)]
    assert len(gateways) == 1
    assert gateways[0].get("deploy", {}).get("replicas", 1) == 1


# -- PostgreSQL: several replicas -----------------------------------------------------------


def test_postgres_kubernetes_deployment() -> None:
    deploy = deployment(K8S_PG / "deployment.yaml")
    spec = deploy["spec"]
    pod = spec["template"]["spec"]
    container = gateway_container(deploy)
    env = container_env(container)

    assert spec["replicas"] >= 2
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    url = env["GATEWAY_DATABASE_URL"]
    assert "value" not in url and url["valueFrom"]["secretKeyRef"]["key"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/_gateway/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/_gateway/healthz"
    assert not any("persistentVolumeClaim" in v for v in pod.get("volumes", []))
    assert pod.get("topologySpreadConstraints") or pod.get("affinity", {}).get("podAntiAffinity")
    selector = spec["selector"]["matchLabels"]
    assert selector.items() <= spec["template"]["metadata"]["labels"].items()


def test_postgres_kubernetes_keeps_the_sqlite_security_context() -> None:
    sqlite, postgres = deployment(K8S / "deployment.yaml"), deployment(K8S_PG / "deployment.yaml")
    pod = "securityContext", "automountServiceAccountToken"
    for key in pod:
        assert postgres["spec"]["template"]["spec"][key] == sqlite["spec"]["template"]["spec"][key]
    assert (
        gateway_container(postgres)["securityContext"]
        == (gateway_container(sqlite)["securityContext"])
    )


def test_postgres_kustomization_reuses_policies_and_service_and_has_no_volume() -> None:
    resources = load(K8S_PG / "kustomization.yaml")["resources"]
    assert "../configmap.yaml" in resources and "../service.yaml" in resources
    assert not any(r.endswith("pvc.yaml") for r in resources)
    (pdb,) = load_all(K8S_PG / "poddisruptionbudget.yaml")
    assert pdb["kind"] == "PodDisruptionBudget" and pdb["spec"]["minAvailable"] >= 1
    labels = deployment(K8S_PG / "deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_postgres_compose_runs_replicas_on_one_database() -> None:
    compose = load(DEPLOY / "compose.postgres.yaml")
    services = compose["services"]
    gateways = {name: s for name, s in services.items() if is_gateway(s)}
    replicas = sum(s.get("deploy", {}).get("replicas", 1) for s in gateways.values())
    assert replicas >= 2
    urls = {compose_env(s)["GATEWAY_DATABASE_URL"] for s in gateways.values()}
    assert len(urls) == 1 and urls.pop().startswith("postgresql://")
    for name, service in gateways.items():
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy", name
        assert all(str(p).startswith("127.0.0.1:") for p in service["ports"]), name
    database = services["postgres"]
    assert database["image"].startswith("postgres:16")
    assert "pg_isready" in database["healthcheck"]["test"]
    assert any(str(v).startswith("postgres-data:") for v in database["volumes"])


# -- PostgreSQL under Patroni (docs/contract.md §19) ------------------------------------------


def test_patroni_compose_names_every_node_and_runs_sync() -> None:
    from gateway.store.pg_hosts import parse_hosts

    compose = load(DEPLOY / "compose.patroni.yaml")
    services = compose["services"]
    gateways = [s for s in services.values() if is_gateway(s)]
    assert len(gateways) >= 2
    nodes = {name for name, s in services.items() if "PATRONI_NAME" in compose_env(s)}
    assert len(nodes) == 3
    for service in gateways:
        env = compose_env(service)
        hosts = parse_hosts(env["GATEWAY_DATABASE_URL"]).hosts
        assert {h.host for h in hosts} == nodes
        assert (env["GATEWAY_REPLICATION"], env["GATEWAY_DURABILITY"]) == ("sync", "strict")
    config = load(DEPLOY / "patroni" / "patroni.yml")
    dcs = config["bootstrap"]["dcs"]
    assert dcs["synchronous_mode"] is True and dcs["synchronous_mode_strict"] is True


def test_patroni_kubernetes_patches_the_postgres_variant_to_sync() -> None:
    folder = K8S / "patroni"
    kustomization = load(folder / "kustomization.yaml")
    assert kustomization["resources"] == ["../postgres"]
    [patch] = kustomization["patches"]
    (container,) = load(folder / patch["path"])["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["GATEWAY_REPLICATION"] == "sync"


# -- both stores ------------------------------------------------------------------------------


def test_kubernetes_termination_grace_outlasts_the_shutdown_grace() -> None:
    for path in (K8S / "deployment.yaml", K8S_PG / "deployment.yaml"):
        deploy = deployment(path)
        container = gateway_container(deploy)
        grace = float(container_env(container)["GATEWAY_SHUTDOWN_GRACE_S"]["value"])
        budget = deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert budget > grace + prestop_sleep(container), path


@pytest.mark.parametrize("name", ["compose.yaml", "compose.postgres.yaml", "compose.patroni.yaml"])
def test_compose_gateways_are_locked_down_and_outlast_the_shutdown_grace(name: str) -> None:
    services = load(DEPLOY / name)["services"]
    gateways = {n: s for n, s in services.items() if is_gateway(s)}
    assert gateways
    for service_name, service in gateways.items():
        where = f"{name}: {service_name}"
        grace = float(compose_env(service).get("GATEWAY_SHUTDOWN_GRACE_S", "10"))
        assert seconds(service["stop_grace_period"]) > grace, where
        assert service["read_only"] is True, where
        assert service["cap_drop"] == ["ALL"], where
        assert "no-new-privileges:true" in service["security_opt"], where
        assert "/tmp" in service["tmpfs"], where
        env = compose_env(service)
        assert env.get("GATEWAY_CLIENTS") or env.get("GATEWAY_ALLOW_OPEN") == "true", where


def test_systemd_stop_timeout_outlasts_the_shutdown_grace() -> None:
    unit = (DEPLOY / "systemd" / "fence-gateway.service").read_text()
    grace = re.search(r"^Environment=GATEWAY_SHUTDOWN_GRACE_S=(\d+)$", unit, re.M)
    timeout = re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M)
    assert grace and timeout and int(timeout[1]) > int(grace[1])


def test_the_image_carries_the_postgres_driver() -> None:
    assert "pip install '/tmp/src[postgres]'" in (DEPLOY / "Dockerfile").read_text()


# -- the example tool and its policy --------------------------------------------------------


def test_example_policy_loads_and_routes_to_the_tool_service() -> None:
    warnings: list[str] = []
    policies = load_policies(DEPLOY / "policies-example", environ={}, warnings=warnings)
    (upstream,) = policies.upstreams.values()
    assert upstream.mount == "/tool"
    tool = load(DEPLOY / "compose.postgres.yaml")["services"]["tool"]
    port = tool["entrypoint"][tool["entrypoint"].index("--port") + 1]
    assert str(upstream.url).rstrip("/") == f"http://tool:{port}"
    (rule,) = policies.rules
    assert rule.match == "job/*" and rule.lease.issuer == "external"
    assert any("hmac_secret_env" in w for w in warnings)  # unsigned on purpose, and said so


async def test_example_tool_echoes_the_fencing_headers() -> None:
    spec = importlib.util.spec_from_file_location("example_tool", DEPLOY / "example_tool.py")
    assert spec and spec.loader
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    async with TestClient(TestServer(tool.make_app())) as client:
        headers = {"X-Fence-Token": "5", "X-Lease-Resource": "job/42", "Idempotency-Key": "k-1"}
        response = await client.post("/jobs/42/run?x=1", data=b"{}", headers=headers)
        assert response.status == 200
        assert await response.json() == {
            "method": "POST",
            "path": "/jobs/42/run?x=1",
            **headers,
        }
