"""Runs one page's examples as a reader would, inside a network namespace of its own.

`python -m tests.docs.sandbox WORKDIR < spec.json` is started by tests/docs/test_examples.py
under `unshare --net`: a fresh loopback where 127.0.0.1:8080 is free whatever else runs on the
machine, so the examples run exactly as written (`curl localhost:8080/…`, the CLI's default
`--url`, a tool at 127.0.0.1:9400). Here it starts the gateway as `make run` does, when the page
talks to it (the shipped `policies/`, on SQLite, at 127.0.0.1:8080; its database in WORKDIR),
then runs the blocks in
page order: Python blocks as scripts, shell blocks with bash (`-e -o pipefail`) in a folder
that looks like the repository's root (its entries linked in, so `.venv/bin/…` and
`deploy/…` resolve, while what an example writes stays in WORKDIR), background blocks left
running until the page ends. It prints one JSON
result per block on stdout: {"where", "ok", "output"}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.harness import REPO_ROOT, GatewayProcess

BLOCK_TIMEOUT_S = 60
PORT_TIMEOUT_S = 20


def loopback_up() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def environment(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env["HOME"] = str(workdir)  # nothing an example writes lands in a real home
    return env


def checkout(workdir: Path) -> Path:
    """A folder whose entries are links to the repository's: a shell block runs from it."""
    root = workdir / "repository"
    root.mkdir()
    for entry in REPO_ROOT.iterdir():
        if entry.name != ".git":
            (root / entry.name).symlink_to(entry)
    return root


def command(block: dict[str, Any], workdir: Path, number: int) -> tuple[list[str], Path]:
    """What runs a block, and the folder it runs in."""
    text = block["text"]
    if block["kind"] == "python":
        named = re.match(r"#\s*([\w.-]+\.py)\s*\n", text)
        script = workdir / (named[1] if named else f"example_{number}.py")
        script.write_text(text)
        return [sys.executable, str(script)], workdir
    if block["lang"] == "console":  # the lines a reader types, after "$ "
        text = "\n".join(line[2:] for line in text.splitlines() if line.startswith("$ "))
    return ["bash", "-e", "-o", "pipefail", "-c", text], workdir / "repository"


def wait_for_port(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + PORT_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing answered on 127.0.0.1:{port} within {PORT_TIMEOUT_S}s")


def run_block(
    block: dict[str, Any], workdir: Path, number: int, background: list[subprocess.Popen[bytes]]
) -> dict[str, Any]:
    argv, cwd = command(block, workdir, number)
    env = environment(workdir)
    if block.get("port") is not None:
        log = workdir / f"background_{number}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        background.append(process)
        try:
            wait_for_port(block["port"], process)
        except TimeoutError as exc:
            return {"ok": False, "output": f"{exc}\n{log.read_text(errors='replace')}"}
        return {"ok": True, "output": ""}
    try:
        done = subprocess.run(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
            timeout=BLOCK_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"ok": False, "output": f"still running after {BLOCK_TIMEOUT_S}s"}
    output = done.stdout.decode(errors="replace")
    ok = done.returncode == 0
    if ok and block.get("expect") is not None and output != block["expect"]:
        return {"ok": False, "output": f"printed:\n{output}\nthe page says:\n{block['expect']}"}
    return {"ok": ok, "output": output + done.stderr.decode(errors="replace")}


async def main(workdir: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    loopback_up()
    checkout(workdir)
    blocks = spec["blocks"]
    gateway = GatewayProcess(workdir, REPO_ROOT / "policies", sweep_interval_s=1.0, port=8080)
    if spec["gateway"]:
        await gateway.start()
    background: list[subprocess.Popen[bytes]] = []
    results = []
    try:
        for number, block in enumerate(blocks):
            result = await asyncio.to_thread(run_block, block, workdir, number, background)
            results.append({"where": block["where"], **result})
    finally:
        for process in background:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if spec["gateway"]:
            gateway.kill9_sync()
    return results


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1]), json.load(sys.stdin)))))
