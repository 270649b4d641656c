"""The examples of docs/guides/agent-frameworks.md ("Recipes, run as written") run as
written, each as a script, with the real packages and no language model (docs/contract.md
§20): against a real gateway subprocess on the shipped policies (their upstream addresses
pointed at this test's tools), a real recording upstream for the HTTP examples and the real
MCP server of tests/mcp/ for the MCP ones. Each prints what the page says it prints, and the
tools show what reached them.

The page marks each of them `<!-- run-by: tests/recipes/test_recipes.py -->` (the convention
of tests/docs/test_examples.py), so this test is their one runner: tests/docs/ checks the
marker and leaves them to it. They stay here rather than in the docs sandbox because they
need what that sandbox does not give a page: tools of the test's own behind the shipped
policies, LangChain's virtualenv, and checks of what reached each tool."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import pytest
import pytest_asyncio
import yaml
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from gateway.client import GatewayClient, LeaseLost
from tests.docs.blocks import blocks_of
from tests.harness import REPO_ROOT, GatewayProcess, RecordingUpstream
from tests.mcp.conftest import McpServerProcess, McpServerView
from tests.recipes.environments import venv_python

PAGE = REPO_ROOT / "docs" / "guides" / "agent-frameworks.md"
THIS_TEST = "tests/recipes/test_recipes.py"  # what the page's run-by markers name
LANGCHAIN_REQUIREMENTS = Path(__file__).with_name("langchain-requirements.txt")


@dataclass(frozen=True)
class Recipe:
    name: str  # the file name its first line gives
    code: str
    output: str  # what the page shows it printing


def page_recipes() -> dict[str, Recipe]:
    """Each block of the page marked run-by this test: a Python block whose first line is
    `# name.py`, and the `text` block after it (`$ python name.py`, then what it prints)."""
    blocks = blocks_of(PAGE, REPO_ROOT)
    found = {}
    for index, block in enumerate(blocks):
        if block.run_by != THIS_TEST:
            continue
        named = re.match(r"# (\S+\.py)\n", block.text)
        assert block.lang == "python" and named, f"{block.where}: not a `# name.py` script"
        shown = blocks[index + 1] if index + 1 < len(blocks) else None
        assert shown is not None and shown.lang == "text", f"{block.where}: no output after it"
        command, _, output = shown.text.partition("\n")
        name = named[1]
        assert command.endswith(f"python {name}"), f"{name}: the output block runs {command!r}"
        found[name] = Recipe(name, block.text, output)
    return found


def test_the_page_s_recipes_are_the_ones_run_here() -> None:
    assert sorted(page_recipes()) == [
        "deploy_httpx.py",
        "deploy_requests.py",
        "langchain_agent.py",
        "mcp_sdk.py",
        "pydantic_ai_agent.py",
    ]


def shipped_policies(workdir: Path, urls: dict[str, str]) -> Path:
    """The shipped policy files, with each named upstream's `url` pointed at this test's."""
    folder = workdir / "policies"
    folder.mkdir()
    for source in sorted((REPO_ROOT / "policies").glob("*.yaml")):
        doc = yaml.safe_load(source.read_text())
        for upstream in doc["upstreams"]:
            upstream["url"] = urls.get(upstream["name"], upstream["url"])
        (folder / source.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder


async def run_recipe(recipe: Recipe, gateway: GatewayProcess, workdir: Path, python: str) -> str:
    script = workdir / recipe.name
    script.write_text(recipe.code)
    env = {
        **os.environ,
        "GATEWAY_URL": gateway.url,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    process = await asyncio.create_subprocess_exec(
        python,
        str(script),
        cwd=workdir,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, output.decode()
    return output.decode()


async def receipts(gateway: GatewayProcess, resource: str) -> list[dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{gateway.url}/_gateway/v1/receipts", params={"resource": resource}) as r,
    ):
        return list((await r.json())["items"])


@pytest.fixture(scope="module")
def mcp_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpServerProcess]:
    with McpServerProcess(tmp_path_factory.mktemp("mcp-server")).serving() as server:
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tools(
    tmp_path_factory: pytest.TempPathFactory, mcp_process: McpServerProcess
) -> AsyncIterator[tuple[GatewayProcess, RecordingUpstream]]:
    """The gateway on the shipped policies, `deploy` at a recording upstream and `mail-mcp`
    at the MCP server, shared by the module's tests: each example acts on a resource of its
    own, so each one's first fence is 1."""
    workdir = tmp_path_factory.mktemp("gateway")
    async with RecordingUpstream(base_path="") as deploy:
        urls = {"deploy": deploy.url, "mail-mcp": mcp_process.url}
        gateway = GatewayProcess(workdir, shipped_policies(workdir, urls))
        await gateway.start()
        try:
            yield gateway, deploy
        finally:
            gateway.kill9_sync()


@pytest.fixture
def server(mcp_process: McpServerProcess) -> McpServerView:
    """The MCP server as one test sees it: what it logged since the test began."""
    return McpServerView(mcp_process)


Tools = tuple[GatewayProcess, RecordingUpstream]


SHARED_LOOP = pytest.mark.asyncio(loop_scope="module")  # the loop the shared tools run on


@SHARED_LOOP
class TestHttpClients:
    """requests and httpx with `auth=lease.auth()` against a fenced HTTP tool."""

    async def test_requests(self, tools: Tools, tmp_path: Path) -> None:
        gateway, deploy = tools
        recipe = page_recipes()["deploy_requests.py"]
        assert await run_recipe(recipe, gateway, tmp_path, sys.executable) == recipe.output
        [call] = [c for c in deploy.received() if c.resource == "deploy/staging"]
        assert (call.method, call.path, json.loads(call.body)) == (
            "POST",
            "/releases",
            {"version": "1.4.2"},
        )
        assert (call.resource, call.fence) == ("deploy/staging", 1)

    async def test_httpx_and_a_lost_lease(self, tools: Tools, tmp_path: Path) -> None:
        gateway, deploy = tools
        recipe = page_recipes()["deploy_httpx.py"]
        assert await run_recipe(recipe, gateway, tmp_path, sys.executable) == recipe.output
        # the call after the loss never reached the tool
        [call] = [c for c in deploy.received() if c.resource == "deploy/canary"]
        assert (call.fence, json.loads(call.body)) == (1, {"version": "1.4.2"})
        [receipt] = await receipts(gateway, "deploy/canary")
        assert receipt["status"] == "succeeded"


@SHARED_LOOP
class TestMcpClients:
    """MCP tool calls through the gateway, fenced by `auth=` or by `_meta`."""

    async def test_the_mcp_sdk_over_httpx2(
        self, tools: Tools, server: McpServerView, tmp_path: Path
    ) -> None:
        gateway, _ = tools
        recipe = page_recipes()["mcp_sdk.py"]
        assert await run_recipe(recipe, gateway, tmp_path, sys.executable) == recipe.output
        assert server.effects("send_email") == [
            {"effect": "send_email", "to": "bob", "text": "the deploy is done"}
        ]
        await self._one_fenced_call(gateway, server, "mailbox/alice")

    async def test_pydantic_ai(self, tools: Tools, server: McpServerView, tmp_path: Path) -> None:
        gateway, _ = tools
        recipe = page_recipes()["pydantic_ai_agent.py"]
        assert await run_recipe(recipe, gateway, tmp_path, sys.executable) == recipe.output
        assert server.effects("send_email") == [{"effect": "send_email", "to": "bob", "text": "hi"}]
        await self._one_fenced_call(gateway, server, "mailbox/carol")

    async def test_langchain_mcp_adapters(
        self, tools: Tools, server: McpServerView, tmp_path: Path
    ) -> None:
        gateway, _ = tools
        python = await asyncio.to_thread(venv_python, LANGCHAIN_REQUIREMENTS)
        recipe = page_recipes()["langchain_agent.py"]
        assert await run_recipe(recipe, gateway, tmp_path, str(python)) == recipe.output
        assert server.effects("send_email") == [{"effect": "send_email", "to": "bob", "text": "hi"}]
        await self._one_fenced_call(gateway, server, "mailbox/dave")

    async def test_a_lost_lease_sends_no_tool_call_through_the_sdk(
        self, tools: Tools, server: McpServerView
    ) -> None:
        """Not an example of the page: what the MCP SDK does when `auth=` refuses to send. The
        call is cancelled and LeaseLost leaves the connection's `async with` (in an exception
        group, from the SDK's task group); no tool call reaches the server."""
        gateway, _ = tools
        async with GatewayClient(gateway.url) as gw:
            lease = gw.lease("mailbox/erin", owner="run-8f21", ttl_s=1, auto_renew=False)
            await lease.acquire()
            url = f"{gateway.url}/mail-mcp/mcp"
            with pytest.raises(ExceptionGroup) as caught:
                async with (
                    httpx2.AsyncClient(auth=lease.auth()) as http,
                    Client(streamable_http_client(url, http_client=http)) as mcp,
                ):
                    await asyncio.sleep(1.1)  # past the TTL, with no renewal
                    await mcp.call_tool("send_email", {"to": "bob", "text": "late"})
            assert caught.group_contains(LeaseLost)
            await lease.release()
        assert server.effects() == []
        assert not any('"tools/call"' in r["body"] for r in server.requests())

    @staticmethod
    async def _one_fenced_call(
        gateway: GatewayProcess, server: McpServerView, resource: str
    ) -> None:
        """The tool call was admitted under fence 1 (a receipt), and what the server received
        carries no lease in `_meta` (the gateway takes it out)."""
        [receipt] = await receipts(gateway, resource)
        assert (receipt["fence"], receipt["status"], receipt["mcp"]["tool"]) == (
            1,
            "succeeded",
            "send_email",
        )
        calls = [r for r in server.requests() if '"tools/call"' in r["body"]]
        assert len(calls) == 1 and "fence-gateway/lease" not in calls[0]["body"]
