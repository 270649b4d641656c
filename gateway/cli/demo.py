"""`fence-gateway demo`: the two-worker race of the seed articles, played live with evidence.

Worker A leases `chat/room-1` (fence 1, TTL 2 s) and stalls in a slow model call, so its
renewals stop. Its lease expires; worker B takes over (fence 2) and sends the message. A wakes
up and sends the same message with fence 1: the gateway refuses it (`409 stale_fence`) before
it reaches the messaging API, and A's renewal is refused (`409 lease_lost`). The evidence is
read back from the messaging API, the receipt API and the lease API; the exit status is 0 only
when it shows exactly one message, sent with fence 2.

A real gateway runs as a subprocess (`python -m gateway serve`) on a free port with a
throwaway SQLite database and policy, so the demo exercises exactly what `serve` runs.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import dataclass
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
from gateway.client import GatewayClient, GatewayError, LeaseHeld, LeaseLost, fenced_headers

RESOURCE = "chat/room-1"
TTL_S = 2
MESSAGE_PATH = "/messages/rooms/room-1/messages"
MESSAGE = {"text": "Deploy of v42 finished, rollback plan attached."}
RUN_TIMEOUT_S = 25.0  # a bound on the whole run, should a call hang
POLICY = """\
upstreams:
  - name: messages
    url: {url}
    mount: /messages
    timeout_s: 5
resources:
  - match: "chat/*"
    upstream: messages
    lease: {{issuer: gateway, ttl_s: {ttl}, max_ttl_s: 60}}
"""


@dataclass(frozen=True, slots=True)
class Delivered:
    """A message as the messaging API received it."""

    fence: str | None
    idempotency_key: str | None
    text: str


async def _start_messaging_api(received: list[Delivered]) -> tuple[web.AppRunner, str]:
    """The stand-in for a messaging API: it records every message and its fence."""

    async def post_message(request: web.Request) -> web.Response:
        body = await request.json()
        received.append(
            Delivered(
                request.headers.get("X-Fence-Token"),
                request.headers.get("Idempotency-Key"),
                body.get("text", ""),
            )
        )
        return web.json_response({"id": f"msg-{len(received)}"}, status=201)

    app = web.Application()
    app.router.add_post("/rooms/{room}/messages", post_message)
    return await serve_locally(app)


async def _race(gw: GatewayClient, say: Timeline) -> dict[str, str]:
    """A stalls past its TTL, B takes over and sends, A wakes and tries the same message.

    Returns what A was told when it woke: {"send": code, "renew": code}.
    """
    told: dict[str, str] = {}
    async with gw.lease(RESOURCE, owner="worker-a", ttl_s=TTL_S, auto_renew=False) as a:
        say("A", f"acquired {RESOURCE}: fence {a.fence}, ttl {TTL_S} s")
        say("A", "starts a slow model call; its lease renewals stall with it")
        try:
            await gw.acquire(RESOURCE, "worker-b", TTL_S)
        except LeaseHeld as held:
            say(
                "B",
                f"asks for {RESOURCE}: 409 lease_held by {held.holder}, "
                f"Retry-After {held.retry_after or 1:g} s; waits politely",
            )
        async with takeover(gw, RESOURCE) as b:
            say("B", f"acquired {RESOURCE}: fence {b.fence} (A's lease expired)")
            sent = await b.post(MESSAGE_PATH, json=MESSAGE)
            say(
                "B",
                f"sends the message with fence {b.fence}: {sent.status}, "
                f"receipt {short(sent.receipt_id or '-')}",
            )
            say(
                "A",
                f"wakes from its model call, past its {TTL_S} s TTL; its client knows: "
                f"lost={a.lost} ({a.lost_reason})",
            )
            say("A", "but say it froze between that check and its send: it sends with fence 1")
            try:
                stale = await gw.request(
                    "POST",
                    MESSAGE_PATH,
                    json=MESSAGE,
                    headers=fenced_headers(RESOURCE, a.fence, a.owner),
                )
                say("A", f"  -> {stale.status}: the stale message went through")
                told["send"] = str(stale.status)
            except GatewayError as exc:
                told["send"] = exc.code
                say("A", f"  -> {exc.status} {exc.code}: refused before the messaging API")
            try:
                await gw.renew(RESOURCE, a.owner, a.fence, TTL_S)
                say("A", "tries to renew -> renewed (it should not have been)")
                told["renew"] = "renewed"
            except GatewayError as exc:
                told["renew"] = exc.code
                say("A", f"tries to renew -> {exc.status} {exc.code}")
            try:
                await a.post(MESSAGE_PATH, json=MESSAGE)
            except LeaseLost:
                say("A", "any further call: LeaseLost raised locally, nothing sent")
        say("B", "done; released its lease")
    return told


async def _evidence(
    gw: GatewayClient, received: list[Delivered], told: dict[str, str], out: Out
) -> list[str]:
    """Prints what the three parties recorded; returns the checks that failed."""
    out(f"\nThe messaging API received {len(received)} message(s):")
    for m in received:
        out(f"  fence {m.fence}  idempotency-key {m.idempotency_key}  {m.text!r}")
    page = await gw.api("GET", "/receipts", params={"resource": RESOURCE})
    receipts: list[dict[str, Any]] = page["items"]
    out(f"\nReceipts (GET /_gateway/v1/receipts?resource={RESOURCE}):")
    row = "  {:<10} {:>5}  {:<9} {:<10} {}"
    out(row.format("id", "fence", "owner", "status", "reject_code"))
    for r in receipts:
        out(
            row.format(
                short(str(r["id"])),
                r["fence"],
                str(r["owner"]),
                r["status"],
                r["reject_code"] or "-",
            )
        )
    lease = await gw.api("GET", f"/leases/{RESOURCE}")
    out(f"\nLease (GET /_gateway/v1/leases/{RESOURCE}):\n  {json.dumps(lease)}")

    def has(status: str, fence: int, owner: str, code: str | None) -> bool:
        return any(
            (r["status"], r["fence"], r["owner"], r["reject_code"]) == (status, fence, owner, code)
            for r in receipts
        )

    checks = {
        "exactly one message reached the messaging API": len(received) == 1,
        "it carried fence 2": [m.fence for m in received] == ["2"],
        "B's call succeeded (receipt succeeded, fence 2)": has("succeeded", 2, "worker-b", None),
        "A's call was rejected stale_fence (fence 1)": has(
            "rejected", 1, "worker-a", "stale_fence"
        ),
        "only one receipt succeeded": sum(r["status"] == "succeeded" for r in receipts) == 1,
        "the lease record holds fence 2": lease.get("fence") == 2,
        "A's stale send was answered stale_fence": told.get("send") == "stale_fence",
        "A's renewal was answered lease_lost": told.get("renew") == "lease_lost",
    }
    return [name for name, ok in checks.items() if not ok]


async def run_demo(out: Out = print) -> int:
    """Play the race against a fresh gateway; 0 when the evidence matches, 1 otherwise."""
    received: list[Delivered] = []
    runner, upstream_url = await _start_messaging_api(received)
    with tempfile.TemporaryDirectory(prefix="fence-gateway-demo-") as tmp_name:
        gateway = DemoGateway(Path(tmp_name))
        try:
            base = await gateway.start(POLICY.format(url=upstream_url, ttl=TTL_S))
            out(f"fence-gateway demo: gateway on {base}, messaging API on {upstream_url}")
            async with GatewayClient(base) as gw, asyncio.timeout(RUN_TIMEOUT_S):
                await gateway.wait_ready(gw.session)
                out(f"\nThe race over {RESOURCE}:")
                told = await _race(gw, Timeline(out))
                failed = await _evidence(gw, received, told, out)
        except (DemoFailed, GatewayError, aiohttp.ClientError, TimeoutError) as exc:
            return gateway.failed(exc, out)
        finally:
            await gateway.stop()
            await runner.cleanup()
    if failed:
        out("\nVerdict: FAILED: " + "; ".join(failed))
        return 1
    out(
        "\nVerdict: one message, sent with fence 2; A's stale call was refused before the "
        "tool (stale_fence) and its renewal answered lease_lost."
    )
    return 0


def main() -> int:
    """Entry point for `fence-gateway demo`."""
    try:
        return asyncio.run(run_demo())
    except KeyboardInterrupt:
        return 130
