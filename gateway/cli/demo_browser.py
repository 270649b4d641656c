"""`fence-gateway demo --browser`: the two-worker race over a real browser session
(docs/contract.md §15).

Chromium runs headless with its DevTools endpoint behind a gateway (`cdp: true`). Worker A
leases `chromium/shop` (fence 1, TTL 2 s), opens a CDP session through the gateway, opens the
shop page in a tab and clicks "buy". It stalls in a slow model call; its lease expires and
worker B takes over (fence 2), connects, finds the same tab and clicks. A wakes up and clicks
on its old connection: the gateway cut that session when B's was admitted, so nothing
reaches the browser. The evidence is the page's own count of clicks and the receipts; the
exit status is 0 only when the page saw A's click and B's, and nothing after B took over.

Chromium is found on the PATH (or /usr/bin/chromium); without it the demo says so and exits
2. The workers speak CDP themselves over `lease.websocket()`, so nothing beyond the gateway's
own dependencies is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.cli.demo_gateway import (
    DemoFailed,
    DemoGateway,
    Out,
    Timeline,
    serve_locally,
    short,
    takeover,
)
from gateway.client import GatewayClient, GatewayError, Lease

RESOURCE = "chromium/shop"
TTL_S = 2
RUN_TIMEOUT_S = 40.0
EXIT_NO_BROWSER = 2
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
POLICY = """\
upstreams:
  - name: chromium
    url: {url}
    mount: /chromium
    timeout_s: 10
    cdp: true
resources:
  - match: "chromium/*"
    upstream: chromium
    lease: {{issuer: gateway, ttl_s: {ttl}, max_ttl_s: 60}}
"""
PAGE = """<!doctype html><title>shop</title>
<button id="buy" onclick="fetch('/click', {method: 'POST', body: window.who + ' ' +
  (++window.clicks)})">buy</button><script>window.clicks = 0; window.who = '?';</script>
"""


class SessionClosed(Exception):
    """The gateway closed the CDP session (its close code and reason)."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"{code} {reason}".strip())
        self.code, self.reason = code, reason


class Cdp:
    """Just enough of the Chrome DevTools Protocol: commands and their answers."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse[Any]) -> None:
        self.ws, self._next = ws, 0

    async def call(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        try:
            await self.ws.send_str(json.dumps(message))
        except (ConnectionError, aiohttp.ClientError) as exc:
            raise SessionClosed(self.ws.close_code, str(exc)) from None
        while True:
            answer = await self.ws.receive(timeout=10)
            if answer.type is aiohttp.WSMsgType.TEXT:
                document = json.loads(answer.data)
                if document.get("id") == self._next:
                    if "error" in document:
                        raise DemoFailed(f"{method}: {document['error']}")
                    result: dict[str, Any] = document.get("result", {})
                    return result
            elif answer.type is aiohttp.WSMsgType.CLOSE:
                raise SessionClosed(answer.data, answer.extra or "")
            elif answer.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                raise SessionClosed(self.ws.close_code, "connection closed")

    async def evaluate(self, session: str, expression: str) -> Any:
        """The value of `expression` in the tab; a script that threw fails the demo."""
        answer = await self.call("Runtime.evaluate", {"expression": expression}, session)
        if "exceptionDetails" in answer:
            raise DemoFailed(f"{expression!r} threw in the page: {answer['exceptionDetails']}")
        return answer.get("result", {}).get("value")

    async def click(self, session: str, who: str) -> None:
        await self.evaluate(
            session, f"window.who = {who!r}; document.getElementById('buy').click()"
        )

    async def wait_for_button(self, session: str) -> None:
        """Until the shop page (not the blank page a new tab starts with) has its button."""
        for _ in range(500):
            if await self.evaluate(session, "document.getElementById('buy') !== null"):
                return
            await asyncio.sleep(0.02)
        raise DemoFailed("the shop page did not load in the tab")


def find_chromium() -> str | None:
    for name in CANDIDATES:
        if found := shutil.which(name):
            return found
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


async def _start_chromium(executable: str, profile: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Headless Chromium on a free debugging port; (process, its HTTP endpoint)."""
    args = [
        executable,
        "--headless",
        "--remote-debugging-port=0",
        "--remote-debugging-address=127.0.0.1",
        f"--user-data-dir={profile}",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-gpu",
        "about:blank",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.insert(1, "--no-sandbox")  # root has no user namespace for the sandbox
    # A session of its own: Chromium's helper processes go with it (`_stop_chromium`).
    process = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )

    def announced() -> str:
        assert process.stderr is not None
        for line in process.stderr:
            if b"DevTools listening on ws://" in line:
                address = line.split(b"ws://", 1)[1].split(b"/", 1)[0].decode()
                # its stderr is read on and dropped, so a full pipe never blocks it
                threading.Thread(target=_drain, args=(process,), daemon=True).start()
                return f"http://{address}"
        raise DemoFailed("Chromium exited without opening its debugging port")

    try:
        return process, await asyncio.wait_for(asyncio.to_thread(announced), 20)
    except BaseException:
        _stop_chromium(process)
        raise


def _stop_chromium(process: subprocess.Popen[bytes]) -> None:
    """Kill Chromium and every helper process it started, and wait: none may still write to
    the profile when its folder is removed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def _drain(process: subprocess.Popen[bytes]) -> None:
    assert process.stderr is not None
    with contextlib.suppress(ValueError, OSError):
        for _ in process.stderr:
            pass


async def _start_shop(clicks: list[str]) -> tuple[web.AppRunner, str]:
    """The web page the workers drive; it records every click it receives."""

    async def page(_request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    async def click(request: web.Request) -> web.Response:
        clicks.append(await request.text())
        return web.Response(status=204)

    app = web.Application()
    app.router.add_get("/shop", page)
    app.router.add_post("/click", click)
    runner, base = await serve_locally(app)
    return runner, f"{base}/shop"


async def _connect(gw: GatewayClient, lease: Lease) -> Cdp:
    """Discovery through the gateway, then the browser's session, fenced by `lease`."""
    async with gw.session.get(
        f"{gw.base_url}/chromium/json/version", headers=lease.cdp_headers()
    ) as answer:
        url = (await answer.json())["webSocketDebuggerUrl"]
    path = "/" + url.split("/", 3)[3]  # ws://gateway/chromium/devtools/browser/… → its path
    return Cdp(await lease.websocket(path, max_msg_size=0))


async def _clicked(clicks: list[str], count: int) -> None:
    for _ in range(1000):  # ten seconds: a busy machine delays the page's fetch
        if len(clicks) >= count:
            return
        await asyncio.sleep(0.01)
    raise DemoFailed("the page did not report the click")


async def _race(gw: GatewayClient, shop: str, clicks: list[str], say: Timeline) -> str:
    """The race; what A's old connection was told when it woke."""
    async with gw.lease(RESOURCE, owner="worker-a", ttl_s=TTL_S, auto_renew=False) as a:
        say("A", f"acquired {RESOURCE}: fence {a.fence}, ttl {TTL_S} s")
        cdp_a = await _connect(gw, a)
        say("A", "connected to the browser through the gateway (a fenced CDP session)")
        target = (await cdp_a.call("Target.createTarget", {"url": shop}))["targetId"]
        tab = (await cdp_a.call("Target.attachToTarget", {"targetId": target, "flatten": True}))[
            "sessionId"
        ]
        # A new tab first holds a blank page whose readyState is already "complete"; clicking
        # there would find no button, so wait for the shop's own.
        await cdp_a.wait_for_button(tab)
        await cdp_a.click(tab, "A")
        await _clicked(clicks, 1)
        say("A", f'opened the shop in a tab and clicked "buy": the page saw {clicks[-1]!r}')
        say("A", "starts a slow model call; its lease renewals stall with it")
        async with takeover(gw, RESOURCE) as b:
            say("B", f"acquired {RESOURCE}: fence {b.fence} (A's lease expired)")
            cdp_b = await _connect(gw, b)
            say("B", "connected to the browser through the gateway")
            targets = (await cdp_b.call("Target.getTargets"))["targetInfos"]
            (mine,) = [t["targetId"] for t in targets if t.get("url") == shop]
            tab_b = (
                await cdp_b.call("Target.attachToTarget", {"targetId": mine, "flatten": True})
            )["sessionId"]
            await cdp_b.click(tab_b, "B")
            await _clicked(clicks, 2)
            say("B", f'found A\'s tab and clicked "buy": the page saw {clicks[-1]!r}')
            say("A", f"wakes from its model call; its client knows: lost={a.lost}")
            say("A", "but say it froze between that check and its click: it clicks anyway")
            try:
                await cdp_a.click(tab, "A")
                told = "sent"
                say("A", "  -> the click went through (it should not have)")
            except SessionClosed as closed:
                told = f"{closed.code} {closed.reason}"
                say("A", f"  -> its session was closed by the gateway ({told}): nothing sent")
            await cdp_b.ws.close()
        say("B", "done; released its lease")
    return told


async def _evidence(gw: GatewayClient, clicks: list[str], told: str, out: Out) -> list[str]:
    out(f"\nThe shop page received {len(clicks)} click(s): {', '.join(clicks)}")
    page = await gw.api("GET", "/receipts", params={"resource": RESOURCE})
    sessions = [r for r in page["items"] if r["kind"] == "session"]
    out(f"\nSession receipts (GET /_gateway/v1/receipts?resource={RESOURCE}):")
    row = "  {:<10} {:>5}  {:<9} {:<10} {:<12} {:>10} {:>8} {:>8}"
    out(row.format("id", "fence", "owner", "status", "closed_by", "close_code", "msgs in", "out"))
    for r in sessions:
        s = r["session"] or {}
        out(
            row.format(
                short(str(r["id"])),
                r["fence"],
                str(r["owner"]),
                r["status"],
                str(s.get("closed_by")),
                str(s.get("close_code")),
                str(s.get("messages_in")),
                str(s.get("messages_out")),
            )
        )
    a = [r for r in sessions if r["owner"] == "worker-a"]
    checks = {
        "the page saw A's click, then B's, and nothing else": clicks == ["A 1", "B 2"],
        "A's session was cut by the gateway": bool(a)
        and (a[0]["session"] or {}).get("closed_by") in ("fenced", "lease_ended"),
        "A's late click was refused": told.split(" ")[0] in ("4409", "4408"),
    }
    return [name for name, ok in checks.items() if not ok]


async def run_demo(out: Out = print, executable: str | None = None) -> int:
    """Play the browser race; 0 when the evidence matches, 1 otherwise, 2 without Chromium."""
    executable = executable or find_chromium()
    if executable is None:
        out(
            "fence-gateway demo --browser needs Chromium (or Chrome), and none was found "
            "on the PATH: install it (apt-get install chromium) and try again"
        )
        return EXIT_NO_BROWSER
    clicks: list[str] = []
    shop_runner, shop = await _start_shop(clicks)
    chromium: subprocess.Popen[bytes] | None = None
    # A helper Chromium forked may still hold a profile file open for a moment: the folder is
    # removed as far as it can be, never failing the demo.
    with tempfile.TemporaryDirectory(
        prefix="fence-gateway-demo-", ignore_cleanup_errors=True
    ) as tmp_name:
        tmp = Path(tmp_name)
        gateway = DemoGateway(tmp)
        try:
            chromium, endpoint = await _start_chromium(executable, tmp / "profile")
            # a long sweep: B's admission is what cuts A's session, not the lease watch
            base = await gateway.start(POLICY.format(url=endpoint, ttl=TTL_S), sweep_interval_s=5)
            out(f"fence-gateway demo --browser: gateway on {base}, Chromium behind it at /chromium")
            async with GatewayClient(base) as gw, asyncio.timeout(RUN_TIMEOUT_S):
                await gateway.wait_ready(gw.session)
                out(f"\nThe race over {RESOURCE} (the shop page is {shop}):")
                told = await _race(gw, shop, clicks, Timeline(out))
                failed = await _evidence(gw, clicks, told, out)
        except (DemoFailed, GatewayError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return gateway.failed(exc, out)
        finally:
            await gateway.stop()
            if chromium is not None:
                _stop_chromium(chromium)
            await shop_runner.cleanup()
    if failed:
        out("\nVerdict: FAILED: " + "; ".join(failed))
        return 1
    out(
        "\nVerdict: two clicks, A's then B's; A's session was cut when B took the browser "
        "over, and its late click never reached the page."
    )
    return 0


def main() -> int:
    """Entry point for `fence-gateway demo --browser`."""
    try:
        return asyncio.run(run_demo())
    except KeyboardInterrupt:
        return 130
