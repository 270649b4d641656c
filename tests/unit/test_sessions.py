"""Sessions, decided (docs/contract.md §15): close codes passed on, the gateway's own ends,
the receipt's `session` object, when the watch cuts a session, the age rule that does not
apply to open sessions; CDP discovery rewriting; and the policy fields and setting."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config.policy import Upstream
from gateway.config.policy_files import PolicyError, load_policies
from gateway.config.settings import Settings
from gateway.core import sessions
from gateway.core.receipts import is_lost
from gateway.core.sessions import Ending, FenceState, SessionRecord, watch_verdict
from gateway.proxy import cdp
from gateway.proxy.relay import Head


class TestCloseCodes:
    @pytest.mark.parametrize(
        ("code", "sent"),
        [
            (1000, 1000),
            (1001, 1001),
            (1003, 1003),
            (1004, 1000),  # reserved
            (1005, 1000),  # "no status": never on the wire
            (1006, 1000),  # "abnormal": never on the wire
            (1007, 1007),
            (1014, 1014),
            (1015, 1000),  # TLS failure: never on the wire
            (2999, 1000),
            (3000, 3000),
            (4409, 4409),
            (4999, 4999),
            (5000, 1000),
            (0, 1000),  # a close frame without a code
            (None, 1000),
        ],
    )
    def test_what_may_go_in_a_close_frame(self, code: int | None, sent: int) -> None:
        assert sessions.sendable(code) == sent

    def test_a_side_s_close_code_and_reason_go_on_to_the_other(self) -> None:
        assert sessions.closed_by_client(4001, "done") == Ending("client", 4001, 4001, 4001, "done")
        assert sessions.closed_by_upstream(1011, "oops") == Ending(
            "upstream", 1011, 1011, 1011, "oops"
        )

    def test_a_close_without_a_code_is_recorded_as_such_and_sent_as_normal(self) -> None:
        ending = sessions.closed_by_client(0)
        assert (ending.close_code, ending.to_upstream) == (1005, 1000)

    def test_a_side_gone_without_a_close_frame(self) -> None:
        assert sessions.closed_by_client(None) == Ending("client", 1006, 1001, 1001, "client_gone")
        # the client hears "bad gateway" when the tool's connection broke
        assert sessions.closed_by_upstream(None).to_client == 1014

    @pytest.mark.parametrize(
        ("closed_by", "code", "reason"),
        [
            ("fenced", 4409, "stale_fence"),
            ("lease_ended", 4408, "lease_expired"),
            ("idle", 1001, "idle"),
            ("limit", 1009, "message_too_big"),
            ("shutdown", 1001, "shutdown"),
            ("error", 1011, "error"),
        ],
    )
    def test_the_gateway_s_own_ends_close_both_sides_alike(
        self, closed_by: sessions.ClosedBy, code: int, reason: str
    ) -> None:
        assert sessions.ended_by_gateway(closed_by) == Ending(closed_by, code, code, code, reason)


class TestSessionRecord:
    def test_the_receipt_s_session_object(self) -> None:
        opened = SessionRecord(opened_at=0.0, messages_in=2, bytes_in=7)
        closed = opened.closed(sessions.ended_by_gateway("fenced"), 1.5)
        assert closed.to_json() == {
            "opened_at": "1970-01-01T00:00:00.000Z",
            "closed_at": "1970-01-01T00:00:01.500Z",
            "closed_by": "fenced",
            "close_code": 4409,
            "messages_in": 2,
            "messages_out": 0,
            "bytes_in": 7,
            "bytes_out": 0,
        }
        assert opened.to_json()["closed_by"] is None


class TestWatch:
    """When the watch cuts an open session of fence 5."""

    @pytest.mark.parametrize(
        ("issuer", "state", "verdict"),
        [
            ("external", FenceState(5), None),
            ("external", FenceState(6), "fenced"),  # a higher fence, admitted anywhere
            ("gateway", FenceState(5, 5, True), None),
            ("gateway", FenceState(6, 6, True), "fenced"),  # fenced first: it says more
            ("gateway", FenceState(5, 5, False), "lease_ended"),  # expired, released, revoked
            ("gateway", FenceState(5, 6, True), "lease_ended"),  # taken over, not yet used
            ("gateway", FenceState(5, None, False), "lease_ended"),  # the record was swept
            ("gateway", None, "lease_ended"),
            ("external", None, None),
        ],
    )
    def test_verdict(self, issuer: str, state: FenceState | None, verdict: str | None) -> None:
        assert watch_verdict(5, issuer, state) == verdict  # type: ignore[arg-type]


class TestAgeRule:
    """§9's age rule does not apply to an open session while its instance lives."""

    def lost(self, heartbeat_at: float, session: bool) -> bool:
        return is_lost(
            in_flight_here=False,
            heartbeat_at=heartbeat_at,
            silent_after_s=3,
            ready_at=10,  # long past
            now=100,
            session=session,
        )

    def test_an_old_call_is_lost_but_an_old_session_of_a_live_instance_is_not(self) -> None:
        assert self.lost(heartbeat_at=99, session=False)
        assert not self.lost(heartbeat_at=99, session=True)

    def test_a_session_of_a_silent_instance_is_lost(self) -> None:
        assert self.lost(heartbeat_at=90, session=True)


CHROMIUM = Upstream(name="chromium", url="http://10.0.0.5:9222", mount="/cdp", cdp=True)
BASE = cdp.PublicBase("ws", "gw:8080", "/cdp")


class TestCdpDiscovery:
    @pytest.mark.parametrize(
        ("method", "rest", "rewritten"),
        [
            ("GET", "/json/version", True),
            ("GET", "/json/version/", True),
            ("GET", "/json/list", True),
            ("GET", "/json/list/", True),
            ("GET", "/json", True),
            ("GET", "/json/", True),
            ("PUT", "/json/new?about:blank", True),
            ("PUT", "/json/new/", True),
            ("GET", "/json/new", False),
            ("POST", "/json/version", False),
            ("GET", "/json/protocol", False),
            ("GET", "/json/version//", False),
            ("GET", "/devtools/browser/x", False),
        ],
    )
    def test_which_answers_are_rewritten(self, method: str, rest: str, rewritten: bool) -> None:
        assert cdp.is_discovery(CHROMIUM, method, rest) is rewritten
        plain = Upstream(name="u", url="http://h", mount="/u", websocket=True)
        assert not cdp.is_discovery(plain, method, rest)

    def test_version_and_list_point_at_the_gateway_and_keep_everything_else(self) -> None:
        version = (
            b'{"Browser": "Chrome/131", "Protocol-Version": "1.3", "webSocketDebuggerUrl": '
            b'"ws://10.0.0.5:9222/devtools/browser/b-1"}'
        )
        assert cdp.rewrite_body(version, BASE, CHROMIUM) is not None
        doc = _json(cdp.rewrite_body(version, BASE, CHROMIUM))
        assert doc == {
            "Browser": "Chrome/131",
            "Protocol-Version": "1.3",
            "webSocketDebuggerUrl": "ws://gw:8080/cdp/devtools/browser/b-1",
        }
        listing = (
            b'[{"id": "P1", "type": "page", "url": "https://example.com/?ws=x", '
            b'"devtoolsFrontendUrl": "/devtools/inspector.html?ws=10.0.0.5:9222/devtools/page/P1",'
            b' "webSocketDebuggerUrl": "ws://10.0.0.5:9222/devtools/page/P1"}]'
        )
        (page,) = _json(cdp.rewrite_body(listing, BASE, CHROMIUM))
        assert page == {
            "id": "P1",
            "type": "page",
            "url": "https://example.com/?ws=x",
            "devtoolsFrontendUrl": "/devtools/inspector.html?ws=gw:8080/cdp/devtools/page/P1",
            "webSocketDebuggerUrl": "ws://gw:8080/cdp/devtools/page/P1",
        }

    def test_wss_and_a_frontend_with_other_parameters(self) -> None:
        secure = cdp.PublicBase("wss", "gw.example.com", "/base/cdp")
        url = (
            "https://chrome-devtools-frontend.appspot.com/serve_rev/@abc/inspector.html"
            "?ws=localhost:9222/devtools/page/P1&remoteFrontend=true#frag"
        )
        assert cdp.frontend_url(url, secure, "") == (
            "https://chrome-devtools-frontend.appspot.com/serve_rev/@abc/inspector.html"
            "?wss=gw.example.com/base/cdp/devtools/page/P1&remoteFrontend=true#frag"
        )
        assert (
            cdp.ws_url("ws://localhost:9222/devtools/page/P1?x=1", secure, "")
            == "wss://gw.example.com/base/cdp/devtools/page/P1?x=1"
        )

    def test_the_upstream_s_base_path_is_not_repeated(self) -> None:
        based = Upstream(name="b", url="http://10.0.0.5:9222/chrome", mount="/cdp", cdp=True)
        body = b'{"webSocketDebuggerUrl": "ws://10.0.0.5:9222/chrome/devtools/browser/b"}'
        assert _json(cdp.rewrite_body(body, BASE, based)) == {
            "webSocketDebuggerUrl": "ws://gw:8080/cdp/devtools/browser/b"
        }

    def test_what_is_not_a_discovery_document_passes_as_it_came(self) -> None:
        for body in (b"not json", b'"a string"', b"[1, 2]", b"\xff"):
            assert cdp.rewrite_body(body, BASE, CHROMIUM) is None
        head = Head(200, [("Content-Length", "8")], b"not json", complete=True, broken=False)
        assert cdp.rewrite_head(head, BASE, CHROMIUM) is head
        failed = Head(500, [], b"{}", complete=True, broken=False)
        assert cdp.rewrite_head(failed, BASE, CHROMIUM) is failed

    def test_the_length_follows_the_rewritten_body(self) -> None:
        body = b'{"webSocketDebuggerUrl": "ws://10.0.0.5:9222/devtools/browser/b"}'
        head = Head(
            200,
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
            body,
            complete=True,
            broken=False,
        )
        rewritten = cdp.rewrite_head(head, BASE, CHROMIUM)
        assert dict(rewritten.headers)["Content-Length"] == str(len(rewritten.prefix))
        assert dict(rewritten.headers)["Content-Type"] == "application/json"


def _json(body: bytes | None) -> object:
    assert body is not None
    return json.loads(body)


class TestPolicyAndSettings:
    def test_cdp_implies_websocket_and_the_limits_have_defaults(self) -> None:
        upstream = Upstream(name="c", url="http://h", mount="/c", cdp=True)
        assert upstream.websocket
        assert upstream.max_message_bytes == 64 * 1024 * 1024
        assert upstream.session_idle_timeout_s == 300
        assert not Upstream(name="p", url="http://h", mount="/p").websocket

    def test_contradictions_and_bad_limits_are_refused_with_file_and_line(
        self, tmp_path: Path
    ) -> None:
        cases = {
            "websocket: false\n    cdp: true": "cdp: true implies websocket: true",
            "websocket: true\n    max_message_bytes: 0": "max_message_bytes",
            "websocket: true\n    session_idle_timeout_s: -1": "session_idle_timeout_s",
            "websocket: maybe": "websocket",
        }
        for fields, message in cases.items():
            path = tmp_path / "p.yaml"
            path.write_text(
                "upstreams:\n  - name: c\n    url: http://h\n    mount: /c\n"
                f"    {fields}\nresources:\n  - {{match: 'c/*', upstream: c}}\n"
            )
            with pytest.raises(PolicyError, match=message) as refused:
                load_policies(path)
            assert "p.yaml:" in str(refused.value)

    def test_a_websocket_upstream_without_rules_is_warned_about(self, tmp_path: Path) -> None:
        path = tmp_path / "p.yaml"
        path.write_text("upstreams:\n  - {name: c, url: 'http://h', mount: /c, cdp: true}\n")
        warnings: list[str] = []
        load_policies(path, warnings=warnings)
        assert any("every upgrade is refused" in warning for warning in warnings)

    def test_the_shipped_browser_policy_has_a_cdp_upstream(self) -> None:
        policies = load_policies(Path(__file__).parents[2] / "policies")
        chromium = policies.upstreams["chromium"]
        assert chromium.cdp and chromium.websocket
        assert policies.rule_for("chromium", "chromium/worker-pool") is not None

    @pytest.mark.parametrize(
        ("value", "kept"),
        [
            ("https://gw.example.com/", "https://gw.example.com"),
            ("http://10.0.0.1:8080/base", "http://10.0.0.1:8080/base"),
        ],
    )
    def test_public_url(self, value: str, kept: str) -> None:
        assert Settings(_env_file=None, public_url=value).public_url == kept

    @pytest.mark.parametrize(
        "value",
        [
            "ws://gw",
            "gw.example.com",
            "https://",
            "https://u:p@gw",
            "https://gw/?q=1",
            "http://g w",
        ],
    )
    def test_a_bad_public_url_is_refused(self, value: str) -> None:
        with pytest.raises(ValidationError):
            Settings(_env_file=None, public_url=value)
