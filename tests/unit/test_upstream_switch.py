"""The gateway refuses an aiohttp whose client would resend a PUT or DELETE on its own.

aiohttp resends "idempotent" methods once on a dead keep-alive connection; only releases whose
`ClientSession` carries `_retry_connection` can be told not to, and on older ones setting it
does nothing. `require_no_resend_switch` reads `ClientSession.ATTRS`, so tests take the switch
away there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import aiohttp
import pytest

from gateway.config.policy import Upstream
from gateway.proxy.upstream import Upstreams, require_no_resend_switch

REPO_ROOT = Path(__file__).resolve().parents[2]


def _floor() -> str:
    """The lowest aiohttp pyproject.toml allows."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (spec,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("aiohttp")]
    match = re.search(r">=\s*([0-9.]+)", spec)
    assert match, spec
    return match.group(1)


@pytest.fixture
def without_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    attrs = frozenset(aiohttp.ClientSession.ATTRS) - {"_retry_connection"}
    monkeypatch.setattr(aiohttp.ClientSession, "ATTRS", attrs)
    monkeypatch.setattr(aiohttp, "__version__", "3.10.11")


def test_the_installed_aiohttp_has_the_switch() -> None:
    require_no_resend_switch()


@pytest.mark.usefixtures("without_switch")
def test_without_the_switch_the_check_names_the_version_and_the_floor() -> None:
    with pytest.raises(RuntimeError) as caught:
        require_no_resend_switch()
    message = str(caught.value)
    assert message.startswith(
        f"aiohttp 3.10.11 is installed, but fence-gateway needs aiohttp>={_floor()}: "
    )
    assert "\n" not in message


@pytest.mark.usefixtures("without_switch")
async def test_without_the_switch_no_upstream_session_is_opened() -> None:
    tool = Upstream(name="tool", url="http://127.0.0.1:9/api", mount="/tool", websocket=True)
    upstreams = Upstreams({"tool": tool})
    with pytest.raises(RuntimeError, match=r"^aiohttp 3\.10\.11 is installed"):
        await upstreams.open()
    # none for its calls, none for its WebSocket sessions
    assert upstreams._pools == {} and upstreams._ws_sessions == {}


def test_serve_without_the_switch_exits_2_with_one_line(tmp_path: Path) -> None:
    script = (
        "import aiohttp\n"
        "aiohttp.ClientSession.ATTRS = frozenset()\n"
        "from gateway.cli.main import main\n"
        "raise SystemExit(main(['serve']))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"fence-gateway: aiohttp {aiohttp.__version__} is installed, "
        f"but fence-gateway needs aiohttp>={_floor()}: "
    )


def test_make_test_floor_pins_the_floor() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    assert f"AIOHTTP_FLOOR := {_floor()}\n" in makefile
