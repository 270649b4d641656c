"""The README's "Checkpoints" example runs as written, against a real gateway on the shipped
policies (docs/contract.md §17), and prints what the README says it prints."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

from tests.harness import REPO_ROOT, GatewayProcess


def readme_example() -> tuple[str, str]:
    """(the Python block, the output block after it) of the README's Checkpoints section."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("\n## Checkpoints\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "no Python example in the Checkpoints section"
    output = re.search(r"```\n(.*?)```", section[code.end() :], re.S)
    assert output is not None, "no output block after the example"
    return code.group(1), output.group(1)


async def test_the_readme_example_runs_as_written(tmp_path: Path) -> None:
    gateway = GatewayProcess(tmp_path, REPO_ROOT / "policies")
    await gateway.start()
    try:
        code, expected = readme_example()
        script = tmp_path / "resume.py"
        script.write_text(code)
        env = {
            **os.environ,
            "GATEWAY_URL": gateway.url,
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            cwd=tmp_path,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, output.decode()
        assert output.decode() == expected
    finally:
        gateway.kill9_sync()
