"""Which tool calls of an MCP upstream are fenced, passed or refused (docs/contract.md §16,
§20: `unmatched_tools`, `unfenced_tools`), and how `check-policies` judges the two fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config.policy_files import PolicyError, load_policies
from gateway.core.mcp import treat_tool
from tests.harness import make_policy, write_policy

FENCED = ("send_*", "deploy")


class TestTreatTool:
    """A pure decision: rule globs first, then `unfenced_tools`, then `unmatched_tools`."""

    @pytest.mark.parametrize(
        ("tool", "unfenced", "unmatched", "treatment"),
        [
            ("send_email", (), "pass", "fenced"),
            ("send_email", (), "refuse", "fenced"),
            ("send_email", ("send_*",), "refuse", "fenced"),  # named by both: the safe side
            ("lookup", (), "pass", "unfenced"),
            ("lookup", ("look*",), "refuse", "unfenced"),
            ("lookup", (), "refuse", "refused"),
            ("lookup", ("list_*",), "refuse", "refused"),
            ("deployer", ("list_*",), "refuse", "refused"),  # a glob matches the whole name
            ("", ("*",), "refuse", "unfenced"),
        ],
    )
    def test_treatment(
        self, tool: str, unfenced: tuple[str, ...], unmatched: Any, treatment: str
    ) -> None:
        assert treat_tool(tool, FENCED, unfenced, unmatched) == treatment

    def test_an_upstream_without_rules_refuses_every_unlisted_tool(self) -> None:
        assert treat_tool("lookup", (), ("lookup",), "refuse") == "unfenced"
        assert treat_tool("send_email", (), ("lookup",), "refuse") == "refused"
        assert treat_tool("send_email", (), (), "pass") == "unfenced"


def load(tmp_path: Path, warnings: list[str] | None = None, **upstream: Any) -> Any:
    rule = {"match": "m/*", "tools": list(FENCED), "lease": {"issuer": "gateway"}}
    policy = make_policy("http://127.0.0.1:1", [rule], **upstream)
    return load_policies(write_policy(tmp_path / "p.yaml", policy), warnings=warnings)


class TestPolicy:
    """`check-policies` validates the fields with file:line errors and warns about `pass`."""

    def test_a_refusing_upstream_loads_without_a_warning(self, tmp_path: Path) -> None:
        warnings: list[str] = []
        policies = load(
            tmp_path, warnings, mcp=True, unmatched_tools="refuse", unfenced_tools=["look*"]
        )
        upstream = policies.upstreams["tool"]
        assert (upstream.unmatched_tools, upstream.unfenced_tools) == ("refuse", ("look*",))
        assert [policies.tool_treatment(upstream, t) for t in ("deploy", "lookup", "new")] == [
            "fenced",
            "unfenced",
            "refused",
        ]
        assert warnings == []

    def test_an_mcp_upstream_left_on_pass_is_warned_about(self, tmp_path: Path) -> None:
        warnings: list[str] = []
        policies = load(tmp_path, warnings, mcp=True)
        assert policies.upstreams["tool"].unmatched_tools == "pass"
        assert warnings == [
            f"{tmp_path / 'p.yaml'}:2: upstream tool is an MCP server left on unmatched_tools: "
            "pass: a tool call no rule's tools name (a tool newly added to the server too) is "
            "forwarded unfenced; say unmatched_tools: refuse and list the read-only tools in "
            "unfenced_tools"
        ]

    def test_a_refusing_upstream_without_rules_is_not_said_to_fail_open(
        self, tmp_path: Path
    ) -> None:
        policy = make_policy("http://127.0.0.1:1", [], mcp=True, unmatched_tools="refuse")
        warnings: list[str] = []
        load_policies(write_policy(tmp_path / "p.yaml", policy), warnings=warnings)
        assert warnings == []

    @pytest.mark.parametrize(
        ("upstream", "message"),
        [
            (
                {"unmatched_tools": "refuse"},
                r"p\.yaml:\d+: upstreams\[0\]\.unmatched_tools: 'refuse': unmatched_tools "
                "applies to upstreams with mcp: true only",
            ),
            (
                {"unfenced_tools": ["x"]},
                r"upstreams\[0\]\.unfenced_tools: unfenced_tools applies to upstreams with "
                "mcp: true only",
            ),
            (
                {"mcp": True, "unmatched_tools": "deny"},
                r"upstreams\[0\]\.unmatched_tools: 'deny': Input should be 'refuse' or 'pass'",
            ),
            (
                {"mcp": True, "unfenced_tools": ["has space"]},
                r"upstreams\[0\]\.unfenced_tools: 'has space' is not a tool glob",
            ),
            (
                {"mcp": True, "unfenced_tools": "lookup"},
                r"upstreams\[0\]\.unfenced_tools: 'lookup': Input should be a valid tuple",
            ),
        ],
    )
    def test_bad_values_name_file_line_and_field(
        self, tmp_path: Path, upstream: dict[str, Any], message: str
    ) -> None:
        with pytest.raises(PolicyError, match=message):
            load(tmp_path, **upstream)

    def test_the_error_points_at_the_fields_line(self, tmp_path: Path) -> None:
        path = tmp_path / "p.yaml"
        path.write_text(
            "upstreams:\n"
            "  - name: tool\n"
            "    url: http://127.0.0.1:1\n"
            "    mount: /tool\n"
            "    unmatched_tools: refuse\n"
        )
        with pytest.raises(PolicyError) as error:
            load_policies(path)
        assert str(error.value) == (
            f"{path}:5: upstreams[0].unmatched_tools: 'refuse': unmatched_tools applies to "
            "upstreams with mcp: true only"
        )
