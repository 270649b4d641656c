"""A virtual environment of its own for an example whose packages cannot share the test venv
(LangChain's MCP adapters pin the 1.x MCP SDK): built once from a requirements file and
cached outside the repository, keyed by a hash of that file and of the Python that builds it,
so a second run costs nothing and a changed file builds a new one. Builds run under a file
lock (several checkouts on one machine share the cache) into a temporary folder that is
renamed into place only when complete, so a build that was killed is never taken for done."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fence-gateway"


def venv_python(requirements: Path) -> Path:
    """The Python of a venv with `requirements` installed, built now if not cached."""
    digest = hashlib.sha256(requirements.read_bytes() + sys.version.encode()).hexdigest()[:16]
    home = CACHE / f"venv-{requirements.stem}-{digest}"
    python = home / "bin" / "python"
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f"{home.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists():
            return python
        building = home.with_name(home.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)
            pip = [str(building / "bin" / "python"), "-m", "pip", "install", "-q"]
            subprocess.run([*pip, "--upgrade", "pip"], check=True)
            subprocess.run([*pip, "-r", str(requirements)], check=True)
        except BaseException:
            with contextlib.suppress(OSError):
                shutil.rmtree(building)
            raise
        building.rename(home)  # the venv's scripts are not used: only bin/python, which moves
        return python
