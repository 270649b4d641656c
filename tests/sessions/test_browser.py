"""A real browser behind the gateway (docs/contract.md §15): Debian's Chromium, driven over
CDP by Playwright for Python through `connect_over_cdp("http://gateway/chromium",
headers=lease.cdp_headers())`, exactly as an agent would.

Worker A holds the lease, opens a page and clicks twice. Then it stalls (a slow model call)
past its lease; worker B takes the lease over, connects, finds the same tab and clicks twice.
A wakes up and clicks: its session was cut when B took over, so the click never reaches the
browser. The page itself (served by the test) records every click it receives: A's two, then
B's two on the same tab, and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.client import GatewayClient
from tests.harness import GatewayFactory, make_policy
from tests.sessions.chromium import playwright_or_fail, running_chromium
from tests.sessions.conftest import settled_receipts

PAGE = """<!doctype html>
<title>orders</title>
<button id="buy" onclick="fetch('/click', {method: 'POST', body: window.who + ' ' +
  (++window.clicks)})">buy</button>
<script>window.clicks = 0; window.who = '?';</script>
"""


class ClickRecorder:
    """The web page the browser shows, and the record of every click it received."""

    def __init__(self) -> None:
        self.clicks: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/orders", self._page)
        app.router.add_post("/click", self._click)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/orders"

    async def _page(self, _request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    async def _click(self, request: web.Request) -> web.Response:
        self.clicks.append(await request.text())
        return web.Response(status=204)

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def click(page: Any, who: str, recorder: ClickRecorder) -> None:
    before = len(recorder.clicks)
    await page.evaluate(f"window.who = {who!r}")
    await page.click("#buy")
    for _ in range(200):  # the page's fetch reaches the recorder
        if len(recorder.clicks) > before:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{who}'s click was not recorded")


@pytest.fixture
async def recorder() -> Any:
    server = ClickRecorder()
    await server.start()
    yield server
    await server.close()


async def test_a_worker_s_browser_session_is_cut_when_another_takes_the_lease_over(
    tmp_path: Path,
    gateway_factory: GatewayFactory,
    session: aiohttp.ClientSession,
    recorder: ClickRecorder,
) -> None:
    playwright_or_fail()
    from playwright.async_api import Error as PlaywrightError
    from playwright.async_api import async_playwright

    async with running_chromium(tmp_path / "profile") as chromium:
        policy = make_policy(
            chromium.http_url,
            [{"match": "chromium/*", "lease": {"issuer": "gateway", "ttl_s": 30, "max_ttl_s": 60},
              "queue_timeout_s": 10}],
            name="chromium",
            mount="/chromium",
            cdp=True,
        )  # fmt: skip
        # a long sweep interval: B's admission, not the lease watch, is what cuts A here
        gw = await gateway_factory(policy, sweep_interval_s=5)
        async with (
            async_playwright() as playwright,
            GatewayClient(gw.url) as worker_a,
            GatewayClient(gw.url) as worker_b,
        ):
            lease_a = worker_a.lease("chromium/shop", owner="worker-a", ttl_s=1.5, auto_renew=False)
            await lease_a.acquire()
            browser_a = await playwright.chromium.connect_over_cdp(
                f"{gw.url}/chromium", headers=lease_a.cdp_headers()
            )
            disconnected = asyncio.Event()
            browser_a.on("disconnected", lambda _: disconnected.set())
            page_a = await browser_a.contexts[0].new_page()
            await page_a.goto(recorder.url)
            await click(page_a, "A", recorder)
            await click(page_a, "A", recorder)

            # A stalls in a slow model call; its lease runs out and B takes it over at once
            lease_b = worker_b.lease("chromium/shop", owner="worker-b", ttl_s=30)
            await lease_b.acquire()  # retries politely until A's lease has expired
            assert lease_b.fence > lease_a.fence
            taken_over = time.monotonic()
            browser_b = await playwright.chromium.connect_over_cdp(
                f"{gw.url}/chromium", headers=lease_b.cdp_headers()
            )
            await asyncio.wait_for(disconnected.wait(), 5)
            assert time.monotonic() - taken_over < 5
            (page_b,) = [
                p for c in browser_b.contexts for p in c.pages if p.url == recorder.url
            ]  # the tab A was driving
            await click(page_b, "B", recorder)
            await click(page_b, "B", recorder)

            # A wakes up and clicks: nothing leaves the gateway for it any more
            with pytest.raises(PlaywrightError):
                await page_a.evaluate("window.who = 'A'")
                await page_a.click("#buy", timeout=2000)
            await asyncio.sleep(0.3)
            assert recorder.clicks == ["A 1", "A 2", "B 3", "B 4"]  # one tab, one counter
            await browser_b.close()
            await lease_b.release()

    receipts = await settled_receipts(session, gw.url, resource="chromium/shop")
    sessions = [r for r in receipts if r["kind"] == "session" and r["status"] != "rejected"]
    by_fence = {r["fence"]: r for r in sessions}
    old = by_fence[lease_a.fence]
    assert old["session"]["closed_by"] in ("fenced", "lease_ended")
    assert old["session"]["close_code"] in (4409, 4408)
    assert old["session"]["messages_in"] > 0 and old["session"]["messages_out"] > 0
    assert old["path"].startswith("/devtools/browser/")
