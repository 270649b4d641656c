"""The operator console in a real browser (docs/console.md): Debian's Chromium driven by
Playwright, against the gateway as a subprocess with a clients file, in front of a real
upstream that loses one call's answer.

A reconciler signs in, finds the `outcome_unknown` receipt that lost call left, is refused a
form sent without its CSRF token, resolves the receipt `not_applied` with a note, sees it
leave the queue, and the next call with its key goes through to the tool. An agent's key is
refused; an admin revokes a lease. Every page is screenshotted at a laptop's and a phone's
width into var/artifacts/console/ (kept by CI as test artifacts); with
UPDATE_CONSOLE_SCREENSHOTS=1 the laptop ones also replace docs/console/*.png, the pictures
the README shows.

The system's Chromium is used, never a downloaded one. Outside CI a machine without it skips
these tests with one line; under CI=true a missing Chromium fails them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.harness import (
    REPO_ROOT,
    Behavior,
    CallResult,
    GatewayFactory,
    GatewayProcess,
    Recorded,
    RecordingUpstream,
    call,
    fenced_headers,
    make_policy,
    problem,
)
from tests.sessions.chromium import chromium_path, playwright_or_fail

ARTIFACTS = REPO_ROOT / "var" / "artifacts" / "console"
DOCS = REPO_ROOT / "docs" / "console"
VIEWPORTS = {"laptop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 844}}
TIMEOUT_S = 0.5  # the tool's timeout: a lost call is reconcilable this long after it left

KEYS = {"agent": "agent-secret-1", "reconciler": "alice-secret-1", "admin": "ann-secret-1"}
LOST_KEY = "charge-42"


def clients_file(path: Path) -> Path:
    def digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    path.write_text(
        "clients:\n"
        f"  - {{name: ops-agent, key_sha256: '{digest(KEYS['agent'])}', roles: [agent],"
        " resources: ['payments/*', 'deploy/*']}\n"
        f"  - {{name: alice, key_sha256: '{digest(KEYS['reconciler'])}', roles: [reconciler]}}\n"
        f"  - {{name: ann, key_sha256: '{digest(KEYS['admin'])}', roles: [admin]}}\n"
    )
    return path


def policy(upstream_url: str) -> dict[str, Any]:
    return make_policy(
        upstream_url,
        [
            {"match": "payments/*", "probe": {"method": "GET", "path": "/ops/{idempotency_key}"}},
            {"match": "deploy/*", "lease": {"issuer": "gateway", "ttl_s": 60, "max_ttl_s": 300}},
        ],
        name="ledger",
        mount="/ledger",
        timeout_s=TIMEOUT_S,
    )


class Tool:
    """The ledger behind the gateway: it answers 201, except that the first call with
    LOST_KEY reaches it and then loses its answer (the connection drops)."""

    def __init__(self, upstream: RecordingUpstream) -> None:
        self.dropped = False
        upstream.default = self.handle

    def handle(self, rec: Recorded) -> Behavior:
        if rec.headers.get("Idempotency-Key") == LOST_KEY and not self.dropped:
            self.dropped = True
            return Behavior(action="close")
        return Behavior(status=201, body=b'{"ok": true}')


async def pay(
    session: aiohttp.ClientSession, gateway: GatewayProcess, fence: int, key: str
) -> CallResult:
    headers = fenced_headers(
        "payments/order-17",
        fence,
        **{"Idempotency-Key": key, "Proxy-Authorization": f"Bearer {KEYS['agent']}"},
    )
    return await call(
        session, "POST", f"{gateway.url}/ledger/charges", data=b'{"cents": 1200}', headers=headers
    )


async def api(
    session: aiohttp.ClientSession, gateway: GatewayProcess, method: str, path: str, **kw: Any
) -> tuple[int, Any]:
    role = kw.pop("role", "admin")
    headers = {"Authorization": f"Bearer {KEYS[role]}"}
    async with session.request(
        method, f"{gateway.url}/_gateway/v1{path}", headers=headers, **kw
    ) as resp:
        return resp.status, (await resp.json(content_type=None) if resp.status != 204 else None)


async def make_history(session: aiohttp.ClientSession, gateway: GatewayProcess) -> str:
    """Calls, refusals, leases and one lost outcome; the lost call's receipt id."""
    for resource, ttl_s in (("deploy/staging", 60), ("deploy/canary", 0.2), ("deploy/web", 60)):
        status, lease = await api(
            session, gateway, "POST", f"/leases/{resource}", role="agent",
            json={"owner": "run-7", "ttl_s": ttl_s},
        )  # fmt: skip
        assert status == 201, lease
    await api(session, gateway, "DELETE", "/leases/deploy/web?owner=run-7&fence=1", role="agent")
    for fence, key in ((1, "charge-40"), (2, "charge-41"), (1, "charge-39"), (1, "charge-38")):
        await pay(session, gateway, fence, key)
        await asyncio.sleep(0.2)  # spread out, so the fence chart has something to show
    lost = await pay(session, gateway, 3, LOST_KEY)
    assert problem(lost)["code"] == "upstream_outcome_unknown"
    await asyncio.sleep(0.2)
    assert (await pay(session, gateway, 3, "charge-43")).status == 201
    return lost.headers["X-Receipt-Id"] if lost.headers else ""


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    executable = chromium_path()
    playwright_or_fail()
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=executable,
            args=["--no-sandbox"],  # root in CI: no user namespace
        )
        yield launched
        await launched.close()


async def shoot(page: Any, name: str) -> None:
    """The page at each width, full length, into the artifacts (and the docs when asked)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for device, viewport in VIEWPORTS.items():
        await page.set_viewport_size(viewport)
        await page.screenshot(path=ARTIFACTS / f"{name}-{device}.png", full_page=True)
    await page.set_viewport_size(VIEWPORTS["laptop"])
    if os.environ.get("UPDATE_CONSOLE_SCREENSHOTS") == "1":
        DOCS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ARTIFACTS / f"{name}-laptop.png", DOCS / f"{name}.png")


async def sign_in(page: Any, gateway: GatewayProcess, key: str) -> Any:
    await page.goto(f"{gateway.url}/_gateway/console/signin")
    await page.fill("#key", key)
    async with page.expect_navigation():
        await page.click("button[type=submit]")
    return page


async def test_a_reconciler_resolves_a_lost_call_in_the_browser(
    tmp_path: Path,
    upstream: RecordingUpstream,
    gateway_factory: GatewayFactory,
    session: aiohttp.ClientSession,
    browser: Any,
) -> None:
    Tool(upstream)
    gateway = await gateway_factory(
        policy(upstream.url),
        extra_env={
            "GATEWAY_CLIENTS": str(clients_file(tmp_path / "clients.yaml")),
            "GATEWAY_RECONCILE_GRACE_S": "0",
        },
    )
    receipt_id = await make_history(session, gateway)
    await asyncio.sleep(TIMEOUT_S + 0.1)  # past forwarded_at + timeout_s + grace (0)
    console = f"{gateway.url}/_gateway/console"
    context = await browser.new_context(viewport=VIEWPORTS["laptop"])
    page = await context.new_page()
    page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))

    # Not signed in: the console sends the browser to the sign-in form.
    await page.goto(console)
    assert page.url == f"{console}/signin"
    await shoot(page, "signin")

    # An agent's key names a client, but agents have no console.
    answer = await sign_in(page, gateway, KEYS["agent"])
    assert "is for reconcilers and admins" in await answer.inner_text("main")
    assert await page.title() == "403 Forbidden · fence-gateway console"
    cookies = await context.cookies()
    assert [c for c in cookies if c["name"] == "fence_console" and c["sameSite"] == "Strict"]
    assert all(c["httpOnly"] for c in cookies)

    # The reconciler signs in and sees the hour on the overview.
    await sign_in(page, gateway, KEYS["reconciler"])
    assert page.url == console
    assert "alice · reconciler" in await page.inner_text("header.top")
    await shoot(page, "overview")

    # The lost call waits in the queue, with what is needed to search the tool's records.
    await page.goto(f"{console}/queue")
    queue = await page.inner_text("main")
    assert receipt_id in queue, f"{queue[:2000]}\n{gateway.stderr_text()[-3000:]}"
    card = page.locator(f"#receipt-{receipt_id}")
    text = await card.inner_text()
    for shown in (LOST_KEY, receipt_id, "payments/order-17", "POST /charges"):
        assert shown in text, (shown, text)
    assert await card.locator("form.probe button").count() == 1  # the rule has a probe
    assert await card.locator("input[name=source]").input_value() == "operator:alice"
    await shoot(page, "queue")

    # A form sent without its CSRF token is refused, and changes nothing.
    await card.locator("input[value=not_applied]").check()
    async with page.expect_navigation():
        await card.locator("form.resolve").evaluate(
            "form => { form.querySelector('input[name=csrf]').remove(); form.submit(); }"
        )
    assert await page.title() == "403 Forbidden · fence-gateway console"
    assert "CSRF token is missing" in await page.inner_text("main")
    status, receipt = await api(session, gateway, "GET", f"/receipts/{receipt_id}")
    assert (status, receipt["status"]) == (200, "outcome_unknown")

    # Resolved not_applied with a note: it leaves the queue...
    await page.goto(f"{console}/queue")
    card = page.locator(f"#receipt-{receipt_id}")
    await card.locator("input[value=not_applied]").check()
    await card.locator("textarea[name=note]").fill("no charge-42 in the ledger")
    async with page.expect_navigation():
        await card.locator("form.resolve button[type=submit]").click()
    assert page.url == f"{console}/queue"
    assert f"receipt {receipt_id} on payments/order-17 resolved not_applied" in (
        await page.inner_text("main")
    )
    assert await page.locator(f"#receipt-{receipt_id}").count() == 0
    status, receipt = await api(session, gateway, "GET", f"/receipts/{receipt_id}")
    assert receipt["status"] == "reconciled"
    assert {k: receipt["resolution"][k] for k in ("outcome", "source", "note")} == {
        "outcome": "not_applied",
        "source": "operator:alice",
        "note": "no charge-42 in the ledger",
    }

    # ...and the next call with its key goes through to the tool, as a second attempt.
    again = await pay(session, gateway, 3, LOST_KEY)
    assert again.status == 201, again.body
    sent = [r for r in upstream.received(method="POST") if r.headers["Idempotency-Key"] == LOST_KEY]
    assert len(sent) == 2
    _, retried = await api(session, gateway, "GET", f"/receipts/{again.headers['X-Receipt-Id']}")
    assert (retried["status"], retried["attempt"]) == ("succeeded", 2)

    # One resource: its fence over time, its receipts in colour, refusals by code.
    await page.goto(f"{console}/resources/payments/order-17")
    assert await page.locator("svg.fence circle.admitted").count() == 5
    assert await page.locator("svg.fence path.refused").count() == 2
    assert "stale_fence" in await page.inner_text("table.codes")
    assert await page.locator("tr.row-rejected").count() == 2
    await shoot(page, "resource")

    # Leases: a reconciler reads them; only an admin gets the revoke button.
    await page.goto(f"{console}/leases")
    assert "deploy/staging" in await page.inner_text("table.rows")
    assert await page.locator("button.danger").count() == 0

    admin = await (await browser.new_context()).new_page()
    admin.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
    await sign_in(admin, gateway, KEYS["admin"])
    await admin.goto(f"{console}/leases")
    await shoot(admin, "leases")
    row = admin.locator("tr", has_text="deploy/staging")
    async with admin.expect_navigation():
        await row.locator("button.danger").click()
    assert "the lease on deploy/staging is revoked" in await admin.inner_text("main")
    _, lease = await api(session, gateway, "GET", "/leases/deploy/staging")
    assert lease["state"] == "released"
    await context.close()
