"""Configuration and the command line at their edges (docs/contract.md §8, §11, §12, §18):
a policy, a setting or an argument the gateway cannot use is refused at once, in one line
naming where it is (exit status 2), never accepted to fail later on every call."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.config.policy_files import PolicyError, load_policies
from tests.harness import make_policy

REPO_ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    clean["PYTHONPATH"] = str(REPO_ROOT)
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        input="",
        capture_output=True,
        text=True,
        cwd=cwd,
        env=clean,
        timeout=60,
    )


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    return lines[0]


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- policy files -------------------------------------------------------------------------------


def test_inject_headers_differing_only_in_case_are_refused(tmp_path: Path) -> None:
    """Header names are case-insensitive: two names differing only in case would be one header,
    the second silently replacing the first on every forwarded call, so they are refused as a
    duplicate key is."""
    text = (
        "upstreams:\n  - name: a\n    url: http://h\n    mount: /a\n"
        "    inject_headers: {Authorization: 'Bearer real', authorization: 'Bearer other'}\n"
    )
    with pytest.raises(PolicyError, match=r"p\.yaml:5: upstreams\[0\]\.inject_headers"):
        load_policies(write(tmp_path, text), {})


@pytest.mark.parametrize(
    "path",
    ["/sessions/{name} now", "/sessions/{name}#x", "/caf\u00e9/{name}", "/a\t/{name}"],
    ids=["space", "fragment", "non-ascii", "tab"],
)
def test_call_template_path_that_breaks_the_request_line_is_refused(
    tmp_path: Path, path: str
) -> None:
    """An on_expiry/probe path goes on the request line as it is (wire.request.encode_head):
    a space would make every sweeper cleanup a malformed request, so the template's path is
    checked as the upstream url's is."""
    text = (
        "upstreams:\n  - {name: a, url: 'http://h', mount: /a}\nresources:\n"
        "  - match: 'x/*'\n    upstream: a\n"
        f'    on_expiry: {{method: DELETE, path: "{path}"}}\n'
    )
    with pytest.raises(PolicyError, match=r"p\.yaml:6: resources\[0\]\.on_expiry\.path"):
        load_policies(write(tmp_path, text), {})


@pytest.mark.parametrize("cdp", ['"true"', "1"])
def test_cdp_true_however_written_implies_websocket(tmp_path: Path, cdp: str) -> None:
    """`cdp: "true"` or `cdp: 1` is a cdp upstream, and so a WebSocket one: the check is made on
    the validated value, not the raw one, or the discovery answers would point at a WebSocket
    the gateway then refuses (501)."""
    text = f"upstreams:\n  - {{name: a, url: 'http://h', mount: /a, cdp: {cdp}}}\n"
    upstream = load_policies(write(tmp_path, text), {}).upstreams["a"]
    assert upstream.cdp is True
    assert upstream.websocket is True


def test_mcp_written_as_1_with_websocket_is_refused(tmp_path: Path) -> None:
    """`mcp: 1` with `websocket: true` is refused as `mcp: true` is: the same upstream."""
    text = "upstreams:\n  - {name: a, url: 'http://h', mount: /a, mcp: 1, websocket: true}\n"
    with pytest.raises(PolicyError, match="mcp: true speaks Streamable HTTP"):
        load_policies(write(tmp_path, text), {})


def test_rule_naming_an_unknown_upstream_names_file_and_line(tmp_path: Path) -> None:
    """docs/contract.md §8: an error names the file, the line and the field, also a rule's
    unknown upstream, which is found only once every file is read."""
    write(tmp_path, "upstreams:\n  - {name: a, url: 'http://h', mount: /a}\n", "a.yaml")
    path = write(
        tmp_path,
        "resources:\n  - match: 'ok/*'\n    upstream: a\n  - match: 'x/*'\n    upstream: nope\n",
        "b.yaml",
    )
    with pytest.raises(PolicyError) as caught:
        load_policies(tmp_path, {})
    assert re.match(rf"{re.escape(str(path))}:[45]: resources\[1\]\.upstream", str(caught.value))


@pytest.mark.parametrize("nesting", ["[" * 2000 + "]" * 2000, "{a: " * 2000 + "1" + "}" * 2000])
def test_deeply_nested_policy_file_exits_2_with_one_line(tmp_path: Path, nesting: str) -> None:
    """PyYAML composes recursively: a deep document raises RecursionError, not a YAMLError,
    and it is refused as any bad YAML is: one line, exit status 2, no traceback."""
    path = write(tmp_path, f"upstreams: {nesting}\n")
    result = run("check-policies", str(path))
    assert result.returncode == 2, result.stderr[-500:]
    assert one_line(result.stderr).startswith(f"fence-gateway: {path}")


async def test_infinite_lease_ttl_is_refused_at_load(make_app: Any, upstream: Any) -> None:
    """`ttl_s: .inf` passes `gt=0`; no duration is infinite (a lease's expiry could not be
    written as a time), so the policy is refused, naming the field."""
    lease = {"issuer": "gateway", "ttl_s": float("inf"), "max_ttl_s": float("inf")}
    with pytest.raises(PolicyError, match="ttl_s"):
        await make_app(make_policy(upstream.url, [{"match": "run/*", "lease": lease}]))


async def test_upstream_host_with_an_empty_label_is_refused_at_load(make_app: Any) -> None:
    """`url: http://a..b:1` is no host name any call could reach (the idna codec refuses it):
    the policy is refused, naming the upstream's url."""
    with pytest.raises(PolicyError, match=r"upstreams\[0\]\.url"):
        await make_app(make_policy("http://a..b:1", [{"match": "run/*"}]))


# -- settings -----------------------------------------------------------------------------------


def test_a_bad_combination_of_settings_names_its_variable(tmp_path: Path) -> None:
    """configuration.md: a bad setting stops the gateway with one line naming the variable,
    also a check across settings (a model-level error, whose `loc` is empty)."""
    result = run("serve", env={"GATEWAY_REPLICATION": "sync"}, cwd=tmp_path)
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "GATEWAY_:" not in line and "Value error" not in line, line
    assert "GATEWAY_REPLICATION" in line, line


# -- leases / receipts / fences against a running gateway --------------------------------------


@pytest.mark.parametrize(
    "url",
    ["http://a..b:8080", "http://127.0.0.1:abc", "http://127.0.0.1:99999"],
    ids=["empty-label", "nonnumeric-port", "port-out-of-range"],
)
def test_a_bad_url_is_a_bad_argument(url: str) -> None:
    """§12: bad arguments exit 2 before any request: a host with an empty label (`a..b`), a
    port that is no number (`:abc`) or out of range (`:99999`) is never tried."""
    result = run("leases", "list", "--url", url)
    assert result.returncode == 2, result.stderr[-500:]
    assert one_line(result.stderr).startswith("fence-gateway:")


@pytest.mark.parametrize("key", ["s3cret\n", "s3cr\u00e9t\u2603"], ids=["newline", "non-latin-1"])
def test_a_bad_gateway_key_is_a_configuration_error(key: str) -> None:
    """A key read from a file with its newline, or not ASCII, is a configuration error in one
    line (exit 2), before http.client would raise on it."""
    result = run("receipts", "list", "--url", "http://127.0.0.1:9", env={"GATEWAY_KEY": key})
    assert result.returncode == 2, result.stderr[-500:]
    assert "GATEWAY_KEY" in one_line(result.stderr)


# -- restore ------------------------------------------------------------------------------------


def _backup(tmp_path: Path) -> Path:
    """A real backup of a fresh store, made by the CLI."""
    database = tmp_path / "live" / "gw.db"
    env = {"GATEWAY_DATABASE_URL": f"sqlite:///{database}"}
    database.parent.mkdir()
    import sqlite3

    from gateway.store.sqlite import SqliteStore

    SqliteStore(database, instance="t")._connect(read_only=False).close()
    assert sqlite3.connect(database).execute("SELECT count(*) FROM fences").fetchone()
    made = tmp_path / "backup.db"
    result = run("backup", str(made), env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return made


@pytest.mark.parametrize("where", ["folder", "under-a-file"])
def test_restore_into_an_unusable_database_path_exits_2(tmp_path: Path, where: str) -> None:
    """§18 / restore.py: a restore that cannot be made is one line and exit 2, nothing changed,
    also when GATEWAY_DATABASE_URL names a folder or a path under a file (an OSError, not a
    traceback)."""
    backup = _backup(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    target = tmp_path / "folder" if where == "folder" else tmp_path / "file" / "gw.db"
    env = {
        "GATEWAY_DATABASE_URL": f"sqlite:///{target}",
        "GATEWAY_POLICIES": str(REPO_ROOT / "policies"),
    }
    result = run("restore", str(backup), env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-500:]
    assert one_line(result.stderr).startswith("fence-gateway:")
