"""A real MCP server for the tests, built with the official `mcp` SDK and served over
Streamable HTTP by uvicorn: `python -m tests.mcp.mcp_server PORT LOG`.

Tools: `send_email` acts (each run is a line in LOG), `deploy` always fails (`isError`),
`lookup` only reads, `send_with_progress` acts and reports progress first (its answer is an
SSE stream when the client asked for progress), `send_slowly` acts after a pause, and
`crash_midway` reports progress and then
kills the whole server, so its SSE answer breaks before the response. Every HTTP request the
server receives is written to LOG too, headers and body, to show what reached it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import uvicorn
from mcp.server.mcpserver import Context, MCPServer

LOG = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("mcp-server.log")


def record(entry: dict[str, Any]) -> None:
    with LOG.open("a") as log:
        log.write(json.dumps(entry) + "\n")


server = MCPServer("fenced-tools")


@server.tool()
def send_email(to: str, text: str) -> str:
    """Sends an email: a side effect."""
    record({"effect": "send_email", "to": to, "text": text})
    return f"sent to {to}"


@server.tool()
def deploy(version: str) -> str:
    """Always fails."""
    record({"effect": "deploy", "version": version})
    raise ValueError(f"deploy of {version} failed")


@server.tool()
def lookup(q: str) -> str:
    """Reads only."""
    return q.upper()


@server.tool()
async def send_with_progress(to: str, ctx: Context) -> str:
    await ctx.report_progress(1, 2, "composing")
    record({"effect": "send_with_progress", "to": to})
    await ctx.report_progress(2, 2, "sent")
    return f"sent to {to}"


@server.tool()
async def send_slowly(to: str, seconds: float, ctx: Context) -> str:
    """Reports progress, takes its time, then acts: a client that leaves meanwhile closes
    the stream, which MCP servers take for a cancellation."""
    await ctx.report_progress(1, 2, "composing")
    await asyncio.sleep(seconds)
    record({"effect": "send_slowly", "to": to})
    return f"sent to {to}"


@server.tool()
async def crash_midway(to: str, ctx: Context) -> str:
    await ctx.report_progress(1, 2, "started")
    record({"effect": "crash_midway", "to": to})
    await asyncio.sleep(0.3)  # the progress event is on its way
    os._exit(3)  # the answer's stream breaks before its response


class Recorded:
    """Writes every request (method, path, headers, body) to LOG before the app sees it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        record(
            {
                "request": scope["method"],
                "path": scope["path"],
                "headers": {k.decode().lower(): v.decode() for k, v in scope["headers"]},
                "body": body.decode("utf-8", "replace"),
            }
        )
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def main() -> None:
    port = int(sys.argv[1])
    app = server.streamable_http_app()
    uvicorn.run(Recorded(app), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
