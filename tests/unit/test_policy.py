"""Policy files: validated at load, errors name file, line and field."""

from pathlib import Path

import pytest

from gateway.policy import PolicyError, load_policies
from gateway.policy.match import glob_matches

GOOD = """\
upstreams:
  - name: browser
    url: http://127.0.0.1:9222/api/
    mount: /browser
    inject_headers: {Authorization: "Bearer ${TOKEN}"}
  - name: browser-admin
    url: https://broker.internal
    mount: /browser/admin
resources:
  - match: "browser/*"
    upstream: browser
    concurrency: serial
    lease: {issuer: external}
"""


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


class TestLoad:
    def test_good_file(self, tmp_path: Path) -> None:
        warnings: list[str] = []
        policies = load_policies(write(tmp_path, GOOD), {"TOKEN": "t0k"}, warnings)
        browser = policies.upstreams["browser"]
        assert browser.url == "http://127.0.0.1:9222/api"
        assert browser.inject_headers == {"Authorization": "Bearer t0k"}
        assert policies.fenced_methods["browser"] == {"POST", "PUT", "PATCH", "DELETE"}
        assert policies.fenced_methods["browser-admin"] == frozenset()
        assert len(warnings) == 1 and "hmac_secret_env" in warnings[0]

    def test_longest_mount_wins_and_prefix_must_end_at_a_segment(self, tmp_path: Path) -> None:
        policies = load_policies(write(tmp_path, GOOD), {"TOKEN": "t"})
        assert policies.route("/browser/admin/x")[0].name == "browser-admin"
        assert policies.route("/browser/x")[0].name == "browser"
        assert policies.route("/browser")[0].name == "browser"
        assert policies.route("/browserx") is None

    def test_folder_merges_and_refuses_duplicate_mounts(self, tmp_path: Path) -> None:
        write(tmp_path, GOOD, "a.yaml")
        write(tmp_path, "upstreams:\n  - {name: other, url: 'http://h', mount: /browser}\n",
              "b.yaml")
        with pytest.raises(PolicyError, match=r"b\.yaml:2: upstreams\[0\]\.mount: '/browser'"):
            load_policies(tmp_path, {"TOKEN": "t"})

    @pytest.mark.parametrize(("text", "message"), [
        ("upstreams:\n  - name: a\n    url: http://h\n    mount: /a\n    timeout_s: 0\n",
         r"p\.yaml:5: upstreams\[0\]\.timeout_s: 0: Input should be greater than 0"),
        ("upstreams:\n  - {name: a, url: 'http://h', mount: /_gateway/x}\n",
         r"p\.yaml:2: upstreams\[0\]\.mount: .*belongs to the gateway"),
        ("upstreams:\n  - {name: a, url: 'ftp://h', mount: /a}\n",
         r"upstreams\[0\]\.url"),
        ("upstreams:\n  - {name: a, url: 'http://h', mount: /a, colour: red}\n",
         r"upstreams\[0\]\.colour: unknown field"),
        ("resources:\n  - {match: 'x/*', upstream: nope}\n", r"names upstream 'nope'"),
        ("upstreams: [\n", r"p\.yaml:\d+: not valid YAML"),
        ("upstreams:\n  - {name: a, url: 'http://h', mount: /a}\nresources:\n"
         "  - match: 'x/*'\n    upstream: a\n    probe: {method: GET, path: '/ops/{key}'}\n",
         r"p\.yaml:6: resources\[0\]\.probe\.path: '/ops/\{key\}': unknown placeholder"),
        ("- 1\n", r"p\.yaml:1: the top level must be a mapping"),
        ("upstreams:\n  - {name: a, url: 'http://h', mount: /a, "
         "inject_headers: {X-K: '${MISSING}'}}\n", r"environment variable MISSING is not set"),
    ])
    def test_errors_name_file_line_and_field(self, tmp_path: Path, text: str,
                                             message: str) -> None:
        with pytest.raises(PolicyError, match=message):
            load_policies(write(tmp_path, text), {})

    def test_shipped_policies_are_valid(self) -> None:
        policies = load_policies(Path(__file__).parents[2] / "policies", {})
        assert {"browser", "deploy", "messages"} <= set(policies.upstreams)


class TestGlobs:
    @pytest.mark.parametrize(("pattern", "resource", "matches"), [
        ("browser/*", "browser/account-42", True),
        ("browser/*", "browser/a/b", False),
        ("chat/**", "chat/a/b/c", True),
        ("deploy/production", "deploy/production", True),
        ("deploy/production", "deploy/production2", False),
        ("a.b/*", "aXb/c", False),
    ])
    def test_glob(self, pattern: str, resource: str, matches: bool) -> None:
        assert glob_matches(pattern, resource) is matches


class TestCallTemplate:
    """Placeholders of sweeper cleanups and probes (SPEC 8)."""

    def test_render(self) -> None:
        from gateway.policy.models import CallTemplate

        template = CallTemplate(method="DELETE",
                                path="/s/{name}/{resource}/{idempotency_key}/{fence}/{receipt_id}")
        assert template.render("browser/acct 1", 7, "k/1?x") == \
            "/s/acct%201/browser%2Facct%201/k%2F1%3Fx/7/{receipt_id}"
        assert template.render("a/b", 1, "k", "01J").endswith("/1/01J")
