"""The alerting rules under deploy/ (deploy/prometheus/alerts.yaml): promtool accepts them and
their unit tests pass, the Kubernetes PrometheusRule carries the same groups, every metric they
read is one the gateway exports, and every runbook link lands on a section of the docs.

promtool comes with Debian's `prometheus` package; without it these skip with one line, except
on CI (`CI=true`), where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.observe.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts.test.yaml"
OPERATOR_RULE = ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml"
# The series a Prometheus server adds itself, not the gateway.
SCRAPE_SERIES = {"up"}


def rules() -> list[dict[str, Any]]:
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    return list(group["rules"])


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing (Debian package prometheus)")
        pytest.skip("promtool is missing (Debian package prometheus)")
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent
    )


class TestPromtool:
    """Prometheus's own checker reads the rules, and their unit tests pass."""

    def test_check_rules(self) -> None:
        run = promtool("check", "rules", RULES.name)
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"SUCCESS: {len(rules())} rules found" in run.stdout

    def test_unit_tests_pass(self) -> None:
        run = promtool("test", "rules", RULE_TESTS.name)
        assert run.returncode == 0, run.stdout + run.stderr

    def test_every_alert_has_a_firing_case(self) -> None:
        tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
        firing = {
            case["alertname"]
            for test in tests
            for case in test["alert_rule_test"]
            if case["exp_alerts"]
        }
        assert firing == {rule["alert"] for rule in rules()}


class TestRules:
    """What an operator reads in an alert holds."""

    def test_the_operator_rule_has_the_same_groups(self) -> None:
        (doc,) = yaml.safe_load_all(OPERATOR_RULE.read_text())
        assert doc["kind"] == "PrometheusRule"
        assert doc["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]

    def test_every_metric_read_is_exported(self) -> None:
        exported = {
            name
            for metric in Metrics(replication="sync").registry.collect()
            for name in (metric.name, f"{metric.name}_total")
        }
        for rule in rules():
            read = set(re.findall(r"\b(fence_gateway_\w+|up)\b(?=[{\s)\[])", rule["expr"]))
            assert read, rule["alert"]
            assert read - SCRAPE_SERIES <= exported, (rule["alert"], read - exported)

    def test_the_replication_gauge_is_exported_only_in_sync(self) -> None:
        """A 0 from a replica that does not check replication would fire the alert."""

        def exported(metrics: Metrics) -> set[str]:
            return {metric.name for metric in metrics.registry.collect()}

        assert "fence_gateway_replication_synchronous" not in exported(Metrics())
        assert "fence_gateway_replication_synchronous" in exported(Metrics(replication="sync"))

    @pytest.mark.parametrize("rule", rules(), ids=lambda rule: rule["alert"])
    def test_each_alert_says_what_to_do_and_where(self, rule: dict[str, Any]) -> None:
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        page, anchor = annotations["runbook"].split("#")
        headings = re.findall(r"^## (\S+)$", (ROOT / page).read_text(), flags=re.MULTILINE)
        assert anchor in {heading.lower() for heading in headings}
        assert anchor == rule["alert"].lower()
