"""The command line as an operator runs it: `python -m gateway ...` in a subprocess.

docs/contract.md §12 (commands; bad arguments or configuration: a one-line message on stderr and
exit status 2) and §8 (`check-policies`: an error names the file, the line and the
field).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, stdin: str = "", env: dict[str, str] | None = None, cwd: Path = REPO_ROOT):
    """Run the CLI with no GATEWAY_* variables from the test's own environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    clean["PYTHONPATH"] = str(REPO_ROOT)
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=clean,
        timeout=30,
    )


def one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    assert "Traceback" not in stderr
    return lines[0]


def test_check_policies_accepts_the_shipped_policies() -> None:
    result = run("check-policies", str(REPO_ROOT / "policies"))
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.startswith("ok:")


BAD_POLICIES = {
    "bad-value": (
        """upstreams:
  - name: tool
    url: http://127.0.0.1:9/api
    mount: /tool
    timeout_s: -1
resources: []
""",
        5,
        "upstreams[0].timeout_s",
    ),
    "unknown-field": (
        """upstreams:
  - name: tool
    url: http://127.0.0.1:9/api
    mount: /tool
resources:
  - match: "a/*"
    upstream: tool
    colour: blue
""",
        8,
        "resources[0].colour",
    ),
    "mount-under-gateway": (
        """upstreams:
  - name: tool
    url: http://127.0.0.1:9/api
    mount: /_gateway/tool
""",
        4,
        "upstreams[0].mount",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_POLICIES))
def test_check_policies_names_file_line_and_field_and_exits_2(tmp_path: Path, case: str) -> None:
    text, line, field = BAD_POLICIES[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = run("check-policies", str(path))
    assert result.returncode == 2
    assert one_line(result.stderr).startswith(f"fence-gateway: {path}:{line}: {field}")
    assert result.stdout == ""


def test_a_bad_setting_stops_serve_with_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run("serve", env={"GATEWAY_PORT": "abc"}, cwd=tmp_path)
    assert result.returncode == 2
    assert "GATEWAY_PORT" in one_line(result.stderr)


@pytest.mark.parametrize("stdin", ["s3cret", "s3cret\n"], ids=["bare", "trailing-newline"])
def test_hash_key_prints_the_sha256_of_the_secret_on_stdin(stdin: str) -> None:
    result = run("hash-key", stdin=stdin)
    assert (result.returncode, result.stdout, result.stderr) == (
        0,
        hashlib.sha256(b"s3cret").hexdigest() + "\n",
        "",
    )


def test_hash_key_with_nothing_on_stdin_exits_2() -> None:
    result = run("hash-key", stdin="")
    assert (result.returncode, result.stdout) == (2, "")
    one_line(result.stderr)


@pytest.mark.parametrize("args", [("frobnicate",), (), ("check-policies", "a", "b")])
def test_bad_arguments_exit_2_with_one_line(args: tuple[str, ...]) -> None:
    result = run(*args)
    assert result.returncode == 2
    assert one_line(result.stderr).startswith("fence-gateway:")
