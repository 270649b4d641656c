"""The operator console on the real app, without a browser (docs/console.md): sign-in and its
cookie, roles, CSRF, HTML errors for every bad request, and changes made exactly as the API
makes them. The browser's own test is tests/e2e/test_console_browser.py."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from typing import Any

import pytest
from aiohttp import FormData

from gateway.console.guard import SESSIONS
from tests.harness import AppFactory, Behavior, InProcessGateway, RecordingUpstream, make_policy

CONSOLE = "/_gateway/console"
KEYS = {"agent": "k-agent", "reconciler": "k-alice", "admin": "k-ann"}
CLIENTS = "clients:\n" + "".join(
    f"  - {{name: {name}, key_sha256: '{hashlib.sha256(KEYS[role].encode()).hexdigest()}',"
    f" roles: [{role}]{extra}}}\n"
    for name, role, extra in (
        ("runner", "agent", ", resources: ['ledger/*', 'deploy/*']"),
        ("alice", "reconciler", ""),
        ("ann", "admin", ""),
    )
)
TIMEOUT_S = 0.2


def policy(upstream_url: str) -> dict[str, Any]:
    return make_policy(
        upstream_url,
        [
            {"match": "ledger/*", "probe": {"method": "GET", "path": "/ops/{idempotency_key}"}},
            {"match": "deploy/*", "lease": {"issuer": "gateway", "ttl_s": 30}},
        ],
        timeout_s=TIMEOUT_S,
    )


@pytest.fixture
async def gw(make_app: AppFactory, upstream: RecordingUpstream) -> InProcessGateway:
    return await make_app(policy(upstream.url), clients=CLIENTS, reconcile_grace_s=0)


@pytest.fixture
async def open_gw(make_app: AppFactory, upstream: RecordingUpstream) -> InProcessGateway:
    return await make_app(policy(upstream.url), reconcile_grace_s=0)


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html[:2000]
    return found.group(1)


async def get(gw: InProcessGateway, path: str) -> tuple[int, Any, str]:
    async with gw.client.get(path, allow_redirects=False) as r:
        return r.status, r.headers, await r.text()


async def post(gw: InProcessGateway, path: str, data: Any) -> tuple[int, Any, str]:
    async with gw.client.post(path, data=data, allow_redirects=False) as r:
        return r.status, r.headers, await r.text()


async def sign_in(gw: InProcessGateway, role: str) -> tuple[int, Any, str]:
    _, _, form = await get(gw, f"{CONSOLE}/signin")
    return await post(gw, f"{CONSOLE}/signin", {"key": KEYS[role], "csrf": csrf_of(form)})


async def lost_call(gw: InProcessGateway, upstream: RecordingUpstream, key: str) -> str:
    """A call on ledger/r1 whose answer is lost, past its grace; its receipt id. A call that
    never reached the tool within the short timeout (a pause of a loaded test process:
    `not_sent`, `upstream_unreachable`) is no lost call: it is made again, under a new key."""
    upstream.script("/api/ops", Behavior(action="close"))
    for attempt in range(3):
        headers = {
            "X-Lease-Resource": "ledger/r1",
            "X-Fence-Token": "1",
            "Idempotency-Key": f"{key}-{attempt}" if attempt else key,
            "Proxy-Authorization": f"Bearer {KEYS['agent']}",
        }
        async with gw.client.post("/tool/ops", data=b"{}", headers=headers) as r:
            assert r.status == 502, await r.text()
            problem = await r.json(content_type=None)
            receipt_id = r.headers["X-Receipt-Id"]
        if problem["code"] != "upstream_unreachable":
            break
    assert problem["code"] == "upstream_outcome_unknown", problem
    upstream.script("/api/ops", Behavior(status=201))
    await asyncio.sleep(TIMEOUT_S + 0.05)
    return receipt_id


async def api(gw: InProcessGateway, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {KEYS['admin']}"}
    async with gw.client.request(method, f"/_gateway/v1{path}", headers=headers, **kwargs) as r:
        return r.status, await r.json(content_type=None) if r.status != 204 else None


def is_html(headers: Any) -> bool:
    return headers["Content-Type"].startswith("text/html")


class TestSignIn:
    async def test_pages_send_a_stranger_to_the_sign_in_form(self, gw: InProcessGateway) -> None:
        for page in ("", "/", "/queue", "/leases", "/resources/ledger/r1"):
            status, headers, _ = await get(gw, CONSOLE + page)
            assert (status, headers["Location"]) == (303, f"{CONSOLE}/signin"), page
        status, headers, html = await post(gw, f"{CONSOLE}/leases/revoke", {"resource": "a"})
        assert status == 401 and is_html(headers) and "sign in first" in html

    async def test_the_console_exemption_from_keys_covers_the_console_only(
        self, gw: InProcessGateway
    ) -> None:
        for path in ("/_gateway/consolex", "/_gateway/v1/receipts"):
            async with gw.client.get(path) as r:
                assert (r.status, r.content_type) == (401, "application/problem+json"), path

    async def test_a_reconciler_gets_a_new_strict_http_only_session_cookie(
        self, gw: InProcessGateway
    ) -> None:
        _, first, form = await get(gw, f"{CONSOLE}/signin")
        before = re.search(r"fence_console=([^;]+)", first["Set-Cookie"])
        status, headers, _ = await post(
            gw, f"{CONSOLE}/signin", {"key": KEYS["reconciler"], "csrf": csrf_of(form)}
        )
        assert (status, headers["Location"]) == (303, CONSOLE)
        cookie = headers["Set-Cookie"]
        for attribute in ("HttpOnly", "SameSite=Strict", "Max-Age=28", "Path=/_gateway/console"):
            assert attribute in cookie, cookie
        assert before and before.group(1) not in cookie  # a new token, not the form's
        status, _, html = await get(gw, CONSOLE)
        assert status == 200 and "alice · reconciler" in html
        assert gw.app[SESSIONS].find(before.group(1)) is None  # the form's token is void now

    async def test_an_agent_and_an_unknown_key_are_refused(self, gw: InProcessGateway) -> None:
        status, headers, html = await sign_in(gw, "agent")
        assert status == 403 and is_html(headers)
        assert "client runner has the role agent" in html
        _, _, form = await get(gw, f"{CONSOLE}/signin")
        status, _, html = await post(
            gw, f"{CONSOLE}/signin", {"key": "nope", "csrf": csrf_of(form)}
        )
        assert status == 401 and "That key names no client." in html
        assert (await get(gw, f"{CONSOLE}/queue"))[0] == 303  # still nobody

    async def test_the_sign_in_form_needs_its_csrf_token(self, gw: InProcessGateway) -> None:
        await get(gw, f"{CONSOLE}/signin")
        status, _, html = await post(gw, f"{CONSOLE}/signin", {"key": KEYS["reconciler"]})
        assert status == 403 and "CSRF token is missing" in html
        assert (await get(gw, f"{CONSOLE}/queue"))[0] == 303

    async def test_signing_out_ends_the_session(self, gw: InProcessGateway) -> None:
        await sign_in(gw, "reconciler")
        _, _, html = await get(gw, CONSOLE)
        status, headers, _ = await post(gw, f"{CONSOLE}/signout", {"csrf": csrf_of(html)})
        assert (status, headers["Location"]) == (303, f"{CONSOLE}/signin")
        assert (await get(gw, CONSOLE))[0] == 303


class TestChanges:
    """Resolve and revoke go through the API's own code: same checks, same records, same
    log lines, plus one saying who acted in the console."""

    async def test_a_resolution_from_the_console_is_the_apis(
        self, gw: InProcessGateway, upstream: RecordingUpstream, caplog: Any
    ) -> None:
        receipt_id = await lost_call(gw, upstream, "k-1")
        await sign_in(gw, "reconciler")
        _, _, queue = await get(gw, f"{CONSOLE}/queue")
        assert f'id="receipt-{receipt_id}"' in queue and 'value="operator:alice"' in queue
        form = {
            "csrf": csrf_of(queue),
            "outcome": "not_applied",
            "source": "operator:alice",
            "note": "no such charge",
            "back": f"{CONSOLE}/queue",
        }
        with caplog.at_level(logging.INFO, logger="fence_gateway"):
            status, headers, _ = await post(gw, f"{CONSOLE}/receipts/{receipt_id}/resolve", form)
        assert (status, headers["Location"]) == (303, f"{CONSOLE}/queue")
        _, receipt = await api(gw, "GET", f"/receipts/{receipt_id}")
        assert receipt["status"] == "reconciled"
        assert {k: receipt["resolution"][k] for k in ("outcome", "source", "note")} == {
            "outcome": "not_applied",
            "source": "operator:alice",
            "note": "no such charge",
        }
        events = {r.getMessage(): r.fields for r in caplog.records if hasattr(r, "fields")}
        assert events["receipt_reconciled"]["receipt_id"] == receipt_id
        assert events["console_action"]["client"] == "alice"
        _, _, after = await get(gw, f"{CONSOLE}/queue")
        assert f'id="receipt-{receipt_id}"' not in after
        assert f"receipt {receipt_id} on ledger/r1 resolved not_applied" in after
        assert (
            gw.metric(
                "fence_gateway_reconciliations_total", outcome="not_applied", source="operator"
            )
            == 1
        )

    async def test_a_refused_resolution_comes_back_as_a_message_and_changes_nothing(
        self, gw: InProcessGateway, upstream: RecordingUpstream
    ) -> None:
        receipt_id = await lost_call(gw, upstream, "k-2")
        await sign_in(gw, "reconciler")
        _, _, queue = await get(gw, f"{CONSOLE}/queue")
        form = {"csrf": csrf_of(queue), "outcome": "applied", "source": "a\x07b"}
        status, headers, _ = await post(gw, f"{CONSOLE}/receipts/{receipt_id}/resolve", form)
        assert (status, headers["Location"]) == (303, f"{CONSOLE}/queue")
        _, _, shown = await get(gw, f"{CONSOLE}/queue")
        assert "Invalid request: source" in shown
        assert (await api(gw, "GET", f"/receipts/{receipt_id}"))[1]["status"] == "outcome_unknown"
        form["source"], form["outcome"] = "operator:alice", "maybe"
        await post(gw, f"{CONSOLE}/receipts/{receipt_id}/resolve", form)
        assert "outcome &#39;maybe&#39;" in (await get(gw, f"{CONSOLE}/queue"))[2]

    async def test_the_probe_button_asks_the_tool(
        self, gw: InProcessGateway, upstream: RecordingUpstream
    ) -> None:
        receipt_id = await lost_call(gw, upstream, "k-3")
        # the key the lost call carried: lost_call makes it again under a new key when the
        # tool was never reached, and the probe asks for the receipt's own
        _, lost = await api(gw, "GET", f"/receipts/{receipt_id}")
        upstream.script(f"/api/ops/{lost['idempotency_key']}", Behavior(status=404))
        await sign_in(gw, "reconciler")
        _, _, queue = await get(gw, f"{CONSOLE}/queue")
        status, _, _ = await post(
            gw, f"{CONSOLE}/receipts/{receipt_id}/probe", {"csrf": csrf_of(queue)}
        )
        assert status == 303
        _, receipt = await api(gw, "GET", f"/receipts/{receipt_id}")
        assert receipt["resolution"]["source"] == "policy:probe"
        assert f"receipt {receipt_id} is not_applied" in (await get(gw, f"{CONSOLE}/queue"))[2]

    async def test_only_an_admin_revokes(self, gw: InProcessGateway, caplog: Any) -> None:
        async with gw.client.post(
            "/_gateway/v1/leases/deploy/web",
            json={"owner": "run-1"},
            headers={"Authorization": f"Bearer {KEYS['agent']}"},
        ) as r:
            assert r.status == 201
        await sign_in(gw, "reconciler")
        _, _, leases = await get(gw, f"{CONSOLE}/leases")
        assert "deploy/web" in leases and "Revoke</button>" not in leases
        form = {"csrf": csrf_of(leases), "resource": "deploy/web"}
        status, headers, html = await post(gw, f"{CONSOLE}/leases/revoke", form)
        assert status == 403 and is_html(headers) and "may not revoke leases" in html

        gw.client.session.cookie_jar.clear()
        await sign_in(gw, "admin")
        _, _, leases = await get(gw, f"{CONSOLE}/leases?state=held")
        assert "Revoke</button>" in leases
        form = {"csrf": csrf_of(leases), "resource": "deploy/web", "back": f"{CONSOLE}/leases"}
        with caplog.at_level(logging.INFO, logger="fence_gateway"):
            status, headers, _ = await post(gw, f"{CONSOLE}/leases/revoke", form)
        assert (status, headers["Location"]) == (303, f"{CONSOLE}/leases")
        assert (await api(gw, "GET", "/leases/deploy/web"))[1]["state"] == "released"
        revoked = [r.fields for r in caplog.records if r.getMessage() == "lease_revoked"]
        assert revoked == [{"resource": "deploy/web", "client": "ann", "action": "release"}]
        form["resource"] = "ledger/r1"  # no gateway-issued lease: refused as by the API
        await post(gw, f"{CONSOLE}/leases/revoke", form)
        assert "Resource not allowed" in (await get(gw, f"{CONSOLE}/leases"))[2]

    async def test_a_form_may_send_the_browser_back_only_inside_the_console(
        self, gw: InProcessGateway
    ) -> None:
        await sign_in(gw, "admin")
        _, _, html = await get(gw, f"{CONSOLE}/leases")
        form = {"csrf": csrf_of(html), "resource": "deploy/x", "back": "https://evil.example/"}
        status, headers, _ = await post(gw, f"{CONSOLE}/leases/revoke", form)
        assert (status, headers["Location"]) == (303, f"{CONSOLE}/leases")


class TestBadRequests:
    """Every bad request gets an HTML page with the right status, never a 500."""

    @pytest.fixture
    async def signed_in(self, gw: InProcessGateway) -> tuple[InProcessGateway, str]:
        await sign_in(gw, "admin")
        _, _, html = await get(gw, CONSOLE)
        return gw, csrf_of(html)

    @pytest.mark.parametrize("after", ["01KBZ5Q3M2", "735.01KBZ5Q3M2"])
    async def test_a_queue_page_goes_on_from_either_store_s_position(
        self, signed_in: Any, after: str
    ) -> None:
        gw, _ = signed_in
        got, _, html = await get(gw, f"{CONSOLE}/queue?after={after}")
        assert got == 200, html[:500]

    @pytest.mark.parametrize(
        ("path", "status"),
        [
            ("/nothing/here", 404),
            ("/queue?after=../x", 400),
            ("/queue?after=1.2.3", 400),
            ("/queue?color=red", 400),
            ("/leases?state=gone", 400),
            ("/leases?after=a//b", 400),
            ("/resources/a//b", 400),
            ("/resources/a/b?window=1y", 400),
            ("/static/secrets.txt", 404),
        ],
    )
    async def test_bad_pages(self, signed_in: Any, path: str, status: int) -> None:
        gw, _ = signed_in
        got, headers, html = await get(gw, CONSOLE + path)
        assert (got, is_html(headers)) == (status, True), html[:500]
        assert "Content-Security-Policy" in headers and headers["Cache-Control"] == "no-store"

    async def test_a_method_a_page_does_not_take_is_405_with_allow(self, signed_in: Any) -> None:
        gw, _ = signed_in
        async with gw.client.put(f"{CONSOLE}/queue") as r:
            assert (r.status, r.headers["Allow"], r.content_type) == (405, "GET, HEAD", "text/html")
        async with gw.client.get(f"{CONSOLE}/receipts/x/resolve") as r:
            assert (r.status, r.headers["Allow"]) == (405, "POST")

    async def test_bad_forms(self, signed_in: Any) -> None:
        gw, csrf = signed_in
        resolve = f"{CONSOLE}/receipts/01ABC/resolve"
        cases: dict[str, Any] = {
            "missing field": {"csrf": csrf, "outcome": "applied"},
            "repeated field": [("csrf", csrf), ("outcome", "applied"), ("outcome", "x")],
        }
        for name, data in cases.items():
            status, headers, _ = await post(gw, resolve, data)
            assert (status, is_html(headers)) == (400, True), name
        upload = FormData()
        upload.add_field("csrf", csrf)
        upload.add_field("outcome", b"applied", filename="outcome.txt")
        upload.add_field("source", "operator:ann")
        assert (await post(gw, resolve, upload))[0] == 400
        async with gw.client.post(
            resolve,
            data=b"csrf=" + csrf.encode() + b"&source=\xff\xfe",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        ) as r:
            assert (r.status, r.content_type) == (400, "text/html")  # not UTF-8: unreadable
        async with gw.client.post(
            resolve,
            data=b"x" * (1024**2 + 10),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        ) as r:
            assert (r.status, r.content_type) == (413, "text/html")
        status, _, _ = await post(gw, resolve, {"csrf": csrf, "outcome": "applied", "source": "a"})
        assert status == 303  # a receipt that does not exist: a message on the queue page
        assert "Not found" in (await get(gw, f"{CONSOLE}/queue"))[2]


class TestOpenGateway:
    async def test_no_sign_in_but_forms_still_need_their_token(
        self, open_gw: InProcessGateway, upstream: RecordingUpstream
    ) -> None:
        gw = open_gw
        receipt_id = await lost_call(gw, upstream, "k-open")
        status, headers, html = await get(gw, f"{CONSOLE}/queue")
        assert status == 200 and "open gateway · no sign-in" in html
        assert "SameSite=Strict" in headers["Set-Cookie"]
        assert 'value="operator:local"' in html
        form = {"outcome": "applied", "source": "operator:local"}
        status, _, _ = await post(gw, f"{CONSOLE}/receipts/{receipt_id}/resolve", form)
        assert status == 403
        form["csrf"] = csrf_of(html)
        status, _, _ = await post(gw, f"{CONSOLE}/receipts/{receipt_id}/resolve", form)
        assert status == 303
        async with gw.client.get(f"/_gateway/v1/receipts/{receipt_id}") as r:
            receipt = await r.json()
        assert (receipt["status"], receipt["resolution"]["outcome"]) == ("reconciled", "applied")
        assert (await get(gw, f"{CONSOLE}/signin"))[1]["Location"] == CONSOLE

    async def test_the_overview_and_resource_pages_draw_their_charts(
        self, open_gw: InProcessGateway, upstream: RecordingUpstream
    ) -> None:
        gw = open_gw
        await lost_call(gw, upstream, "k-chart")
        status, _, overview = await get(gw, CONSOLE)
        assert status == 200 and overview.count('<svg class="chart bars') == 3
        status, _, page = await get(gw, f"{CONSOLE}/resources/ledger/r1?window=1h")
        assert status == 200 and '<circle class="admitted"' in page
        assert '<span class="badge status-outcome_unknown">' in page


class TestHolds:
    """The overview names the external globs on hold after a restore or a failover."""

    async def test_the_external_globs_on_hold_are_shown_until_raised(
        self, open_gw: InProcessGateway
    ) -> None:
        gw = open_gw
        _, _, before = await get(gw, CONSOLE)
        assert "External resources on hold" not in before
        await gw.store.apply_restore(1000)
        _, _, held = await get(gw, CONSOLE)
        assert "External resources on hold" in held and "<li><code>ledger/*</code></li>" in held
        await gw.store.raise_fences("ledger/**", 5)
        _, _, raised = await get(gw, CONSOLE)
        assert "External resources on hold" not in raised


class TestApiEdges:
    """What the OpenAPI document promises about methods, cursors and numbers."""

    async def test_an_undocumented_method_is_405_with_allow(
        self, open_gw: InProcessGateway
    ) -> None:
        async with open_gw.client.patch("/_gateway/v1/leases/deploy/x") as r:
            body = await r.json()
            assert (r.status, body["code"]) == (405, "method_not_allowed")
            assert r.headers["Allow"] == "DELETE, GET, HEAD, POST, PUT"
        async with open_gw.client.patch("/_gateway/v1/nothing") as r:
            assert r.status == 404

    async def test_a_whole_number_written_as_a_float_is_a_fence(
        self, open_gw: InProcessGateway
    ) -> None:
        _, _, lease = await open_gw.acquire("deploy/x", owner="run-1")
        async with open_gw.client.put(
            "/_gateway/v1/leases/deploy/x",
            data=b'{"owner": "run-1", "fence": 1.0, "ttl_s": 5e0}',
        ) as r:
            assert r.status == 200, await r.text()
        assert lease["fence"] == 1
