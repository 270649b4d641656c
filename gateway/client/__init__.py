"""The library an agent imports to hold a lease and make fenced calls through fence-gateway.

    async with GatewayClient("http://127.0.0.1:8080", key=os.environ["GATEWAY_KEY"]) as gw:
        async with gw.lease("browser/account-42", owner="run-8f21", ttl_s=30) as lease:
            page = await lease.post("/browser/sessions/7/click", json={"x": 10, "y": 20})
            print(page.status, page.json(), page.receipt_id)
            await slow_model_call()            # renewal keeps running in the background
            lease.check()                       # before a side effect that is not an HTTP call
            await lease.post("/browser/sessions/7/type", json={"text": "hi"})
            await lease.checkpoint("typed", {"session": 7})  # where a successor resumes
            async with await lease.websocket("/cdp/devtools/browser") as ws:  # a fenced session
                await ws.send_str('{"id": 1, "method": "Browser.getVersion"}')
            # httpx, httpx2, requests: auth=lease.auth() fences every request they send
            # Playwright over CDP: connect_over_cdp(url, headers=lease.cdp_headers())
            # MCP: auth=lease.auth() on the client's httpx2 client, or
            # call_tool(..., meta=lease.mcp_meta()) on each tool call
        view = await gw.resume("browser/account-42")   # a successor: checkpoint, calls since
    # LeaseHeld: the acquire gave up after acquire_timeout_s of polite retries.
    # LeaseLost: renewal failed or the local deadline passed; raised before any byte is sent.
    # GatewayError: any other problem+json the gateway answered (code = docs/contract.md §5 code).

Without an event loop, `SyncGatewayClient` does the same (renewal on a thread):

    with SyncGatewayClient(url) as gw, gw.lease("browser/account-42", owner="run-8f21") as lease:
        lease.post("/browser/sessions/7/click", json={"x": 10})

Modules: `aio` (aiohttp) and `sync` (the standard library) send; `leasing` decides what both
send and when, `errors` reads the gateway's answers, `fencing` builds what a fenced call
carries for any other HTTP client, `records` holds the answers as values.
"""

from .aio import GatewayClient, Lease
from .errors import LOST_CODES, GatewayError, LeaseHeld, LeaseLost
from .fencing import FencedAuth, fenced_auth, fenced_headers, mcp_meta
from .leasing import RENEW_FRACTION, RENEW_JITTER, renew_delay
from .records import CheckpointInfo, LeaseInfo, Response, RunView
from .sync import SyncGatewayClient, SyncLease

__all__ = [
    "LOST_CODES",
    "RENEW_FRACTION",
    "RENEW_JITTER",
    "CheckpointInfo",
    "FencedAuth",
    "GatewayClient",
    "GatewayError",
    "Lease",
    "LeaseHeld",
    "LeaseInfo",
    "LeaseLost",
    "Response",
    "RunView",
    "SyncGatewayClient",
    "SyncLease",
    "fenced_auth",
    "fenced_headers",
    "mcp_meta",
    "renew_delay",
]
