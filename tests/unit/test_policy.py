"""Policy files: validated at load, errors name file, line and field."""

from pathlib import Path

import pytest

from gateway.config.policy import Upstream
from gateway.config.policy_files import PolicyError, load_policies
from gateway.core.globs import glob_matches

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


RULE_BASE = """\
upstreams:
  - {name: a, url: 'http://h', mount: /a}
resources:
  - match: 'a/*'
    upstream: a
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
        assert browser.authority == "127.0.0.1:9222"
        assert len(warnings) == 2 and "hmac_secret_env" in warnings[0]

    def test_an_upstream_without_rules_loads_with_a_warning(self, tmp_path: Path) -> None:
        """It fails open (nothing fenced, no receipt), so start and check-policies say so."""
        warnings: list[str] = []
        path = write(tmp_path, GOOD)
        policies = load_policies(path, {"TOKEN": "t"}, warnings)
        assert "browser-admin" in policies.upstreams
        assert warnings[1] == (
            f"{path}:6: upstream browser-admin has no resource rule: every "
            "call to it is forwarded unfenced, without a receipt"
        )
        assert not any("upstream browser " in w for w in warnings)

    def test_longest_mount_wins_and_prefix_must_end_at_a_segment(self, tmp_path: Path) -> None:
        policies = load_policies(write(tmp_path, GOOD), {"TOKEN": "t"})
        assert policies.route("/browser/admin/x")[0].name == "browser-admin"
        assert policies.route("/browser/x")[0].name == "browser"
        assert policies.route("/browser")[0].name == "browser"
        assert policies.route("/browserx") is None

    def test_folder_merges_and_refuses_duplicate_mounts(self, tmp_path: Path) -> None:
        write(tmp_path, GOOD, "a.yaml")
        write(
            tmp_path, "upstreams:\n  - {name: other, url: 'http://h', mount: /browser}\n", "b.yaml"
        )
        with pytest.raises(PolicyError, match=r"b\.yaml:2: upstreams\[0\]\.mount: '/browser'"):
            load_policies(tmp_path, {"TOKEN": "t"})

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            (
                "upstreams:\n  - name: a\n    url: http://h\n    mount: /a\n    timeout_s: 0\n",
                r"p\.yaml:5: upstreams\[0\]\.timeout_s: 0: Input should be greater than 0",
            ),
            (
                "upstreams:\n  - {name: a, url: 'http://h', mount: /_gateway/x}\n",
                r"p\.yaml:2: upstreams\[0\]\.mount: .*belongs to the gateway",
            ),
            ("upstreams:\n  - {name: a, url: 'ftp://h', mount: /a}\n", r"upstreams\[0\]\.url"),
            (
                "upstreams:\n  - {name: a, url: 'http://h', mount: /a, colour: red}\n",
                r"upstreams\[0\]\.colour: unknown field",
            ),
            ("resources:\n  - {match: 'x/*', upstream: nope}\n", r"names upstream 'nope'"),
            ("upstreams: [\n", r"p\.yaml:\d+: not valid YAML"),
            (
                "upstreams:\n  - {name: a, url: 'http://h', mount: /a}\nresources:\n"
                "  - match: 'x/*'\n    upstream: a\n    probe: {method: GET, path: '/ops/{key}'}\n",
                r"p\.yaml:6: resources\[0\]\.probe\.path: '/ops/\{key\}': unknown placeholder",
            ),
            ("- 1\n", r"p\.yaml:1: the top level must be a mapping"),
            (
                "upstreams:\n  - {name: a, url: 'http://h', mount: /a, "
                "inject_headers: {X-K: '${MISSING}'}}\n",
                r"environment variable MISSING is not set",
            ),
        ],
    )
    def test_errors_name_file_line_and_field(self, tmp_path: Path, text: str, message: str) -> None:
        with pytest.raises(PolicyError, match=message):
            load_policies(write(tmp_path, text), {})

    @pytest.mark.parametrize(
        ("url", "problem"),
        [
            ("http://h:99999", r"port '99999' is not a number from 1 to 65535"),
            ("http://h:0", r"port '0'"),
            ("http://h:", r"port ''"),
            ("http://h:80x/", r"port '80x'"),
            ("http://user:pass@h", r"no user:password@ .*inject_headers"),
            ("https://token@h/api", r"no user:password@"),
            ("http://h st/", r"no spaces or control characters"),
            ("http://[zz]:80/", r"does not appear to be an IPv4 or IPv6 address"),
        ],
    )
    def test_bad_upstream_urls(self, tmp_path: Path, url: str, problem: str) -> None:
        text = f"upstreams:\n  - name: a\n    mount: /a\n    url: '{url}'\n"
        with pytest.raises(PolicyError, match=r"p\.yaml:4: upstreams\[0\]\.url: .*" + problem):
            load_policies(write(tmp_path, text), {})

    @pytest.mark.parametrize(
        ("url", "authority"),
        [
            ("http://h:65535/base/", "h:65535"),
            ("https://Broker.internal", "Broker.internal"),
            ("http://[::1]:8080", "[::1]:8080"),
            ("http://my_service.local", "my_service.local"),
        ],
    )
    def test_authority_is_host_and_port_only(self, url: str, authority: str) -> None:
        assert Upstream(name="a", url=url, mount="/a").authority == authority

    @pytest.mark.parametrize(
        "mount",
        [
            "/a?b",
            "/a b",
            "/a%20b",
            "/a%",
            "/a#b",
            "/a/",
            "/a//b",
            "/",
            "a",
            "/a/./b",
            "/ä",
        ],
    )
    def test_bad_mounts(self, tmp_path: Path, mount: str) -> None:
        text = f"upstreams:\n  - name: a\n    url: http://h\n    mount: '{mount}'\n"
        with pytest.raises(PolicyError, match=r"p\.yaml:4: upstreams\[0\]\.mount: "):
            load_policies(write(tmp_path, text), {})

    def test_a_mount_may_use_every_unreserved_path_character(self, tmp_path: Path) -> None:
        mount = "/a-b.c_d~e/!$&'()*+,;=:@/Z9"
        text = f"upstreams:\n  - {{name: a, url: 'http://h', mount: \"{mount}\"}}\n"
        policies = load_policies(write(tmp_path, text), {})
        assert policies.route(mount + "/x") == (policies.upstreams["a"], "/x")

    @pytest.mark.parametrize("statuses", ["[200]", "[204, 503]", "[99]", "[600]", "[0]"])
    def test_retry_statuses_are_failures_only(self, tmp_path: Path, statuses: str) -> None:
        text = f"{RULE_BASE}    idempotency:\n      retry_statuses: {statuses}\n"
        with pytest.raises(
            PolicyError,
            match=r"p\.yaml:7: resources\[0\]\.idempotency\.retry_statuses: "
            r"(.* is a success|.* is not an HTTP status)",
        ):
            load_policies(write(tmp_path, text), {})

    def test_retry_statuses_may_name_any_failure(self, tmp_path: Path) -> None:
        text = f"{RULE_BASE}    idempotency: {{retry_statuses: [100, 302, 409, 500, 599]}}\n"
        [rule] = load_policies(write(tmp_path, text), {}).rules
        assert rule.idempotency.retry_statuses == {100, 302, 409, 500, 599}

    def test_a_rule_must_fence_some_method(self, tmp_path: Path) -> None:
        text = f"{RULE_BASE}    fenced_methods: []\n"
        with pytest.raises(
            PolicyError,
            match=r"p\.yaml:6: resources\[0\]\.fenced_methods: "
            r"at least one method",
        ):
            load_policies(write(tmp_path, text), {})


class TestDuplicateKeys:
    """YAML keeps the last of two equal keys silently; a policy file refuses them."""

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            (
                "upstreams:\n  - name: a\n    url: http://h\n    mount: /a\n    url: http://evil\n",
                r"p\.yaml:5: duplicate key 'url' \(first at line 3\)",
            ),
            (
                f"{RULE_BASE}    fenced_methods: [POST]\n    fenced_methods: []\n",
                r"p\.yaml:7: duplicate key 'fenced_methods' \(first at line 6\)",
            ),
            (
                "upstreams: []\nresources: []\n"
                "upstreams:\n  - {name: a, url: 'http://h', mount: /a}\n",
                r"p\.yaml:3: duplicate key 'upstreams' \(first at line 1\)",
            ),
            (
                "upstreams:\n  - {name: a, url: 'http://h', mount: /a, mount: /b}\n",
                r"p\.yaml:2: duplicate key 'mount'",
            ),
            (
                f"{RULE_BASE}    lease: {{ttl_s: 5, max_ttl_s: 10, ttl_s: 50}}\n",
                r"p\.yaml:6: duplicate key 'ttl_s'",
            ),
        ],
        ids=["upstream-field", "rule-field", "top-level", "flow-mapping", "nested-flow"],
    )
    def test_refused_with_file_and_line(self, tmp_path: Path, text: str, message: str) -> None:
        with pytest.raises(PolicyError, match=message):
            load_policies(write(tmp_path, text), {})

    def test_merge_keys_may_be_overridden_and_lines_stay_right(self, tmp_path: Path) -> None:
        """`<<: *base` then `mount:` is an override, not a duplicate; an error in the override
        is reported at its own line, not at the line of the mapping merged in."""
        base = "upstreams:\n  - &base {name: a, url: 'http://h', mount: /a}\n  - <<: *base\n"
        policies = load_policies(write(tmp_path, base + "    name: b\n    mount: /b\n"), {})
        assert (policies.upstreams["b"].url, policies.upstreams["b"].mount) == ("http://h", "/b")
        bad = base + "    name: b\n    mount: /_gateway/b\n"
        with pytest.raises(PolicyError, match=r"p\.yaml:5: upstreams\[1\]\.mount: "):
            load_policies(write(tmp_path, bad), {})

    def test_shipped_policies_are_valid(self) -> None:
        policies = load_policies(Path(__file__).parents[2] / "policies", {})
        assert {"browser", "deploy", "messages"} <= set(policies.upstreams)


class TestGlobs:
    @pytest.mark.parametrize(
        ("pattern", "resource", "matches"),
        [
            ("browser/*", "browser/account-42", True),
            ("browser/*", "browser/a/b", False),
            ("chat/**", "chat/a/b/c", True),
            ("deploy/production", "deploy/production", True),
            ("deploy/production", "deploy/production2", False),
            ("a.b/*", "aXb/c", False),
        ],
    )
    def test_glob(self, pattern: str, resource: str, matches: bool) -> None:
        assert glob_matches(pattern, resource) is matches


class TestCallTemplate:
    """Placeholders of sweeper cleanups and probes (docs/contract.md §8)."""

    def test_render(self) -> None:
        from gateway.config.policy import CallTemplate

        template = CallTemplate(
            method="DELETE", path="/s/{name}/{resource}/{idempotency_key}/{fence}/{receipt_id}"
        )
        assert (
            template.render("browser/acct 1", 7, "k/1?x")
            == "/s/acct%201/browser%2Facct%201/k%2F1%3Fx/7/{receipt_id}"
        )
        assert template.render("a/b", 1, "k", "01J").endswith("/1/01J")


class TestWhatReachesTheWire:
    """Policy values that would go onto every request line or header block as they are."""

    @pytest.mark.parametrize(
        ("url", "ok"),
        [
            ("http://h/api/v1", True),
            ("http://h/a%20b", True),
            ("http://h/a b", False),
            ("http://h/a\tb", False),
            ("http://h/é", False),
        ],
    )
    def test_url_path(self, url: str, ok: bool) -> None:
        from pydantic import ValidationError

        from gateway.config.policy import Upstream

        try:
            Upstream(name="a", url=url, mount="/a")
        except ValidationError:
            assert not ok
        else:
            assert ok

    @pytest.mark.parametrize(
        "name",
        [
            "Content-Length",
            "transfer-encoding",
            "Host",
            "X-Fence-Token",
            "Idempotency-Key",
            "X-Receipt-Id",
        ],
    )
    def test_inject_headers_cannot_override_framing_or_fencing(self, name: str) -> None:
        from pydantic import ValidationError

        from gateway.config.policy import Upstream

        with pytest.raises(ValidationError, match="set by the gateway itself"):
            Upstream(name="a", url="http://h", mount="/a", inject_headers={name: "1"})
