"""The documentation site builds with no warning (a broken link or anchor fails it), the
README's own links hold, and the site's hand-written reference pages name everything the code
has: every setting, every policy field, every error code. (The HTTP API and command-line
pages are generated from the code at every build: docs/generate/reference.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from gateway.config import policy
from gateway.config.settings import Settings
from gateway.core.errors import BY_CODE
from tests.harness import REPO_ROOT

DOCS = REPO_ROOT / "docs"


def test_the_site_builds_strict(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO_ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "reference" / "http-api" / "index.html").exists()
    assert (tmp_path / "reference" / "openapi.json").exists()
    commands = (tmp_path / "reference" / "cli" / "index.html").read_text()
    assert "fence-gateway receipts resolve" in commands and "--floor-only" in commands


def test_every_setting_is_documented() -> None:
    page = (DOCS / "operations" / "configuration.md").read_text()
    missing = [
        f"GATEWAY_{name.upper()}"
        for name in Settings.model_fields
        if f"`GATEWAY_{name.upper()}`" not in page
    ]
    assert not missing, f"settings missing from docs/operations/configuration.md: {missing}"


def _fields(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields)


def test_every_policy_field_is_documented() -> None:
    page = (DOCS / "operations" / "policies.md").read_text()
    models = [policy.Upstream, policy.ResourceRule, policy.Lease, policy.Idempotency]
    missing = [
        f"{model.__name__}.{name}"
        for model in models
        for name in _fields(model)
        if f"| `{name}` |" not in page
    ]
    tls = [name for name in _fields(policy.Tls) if f"`{name}`" not in page]
    assert not missing and not tls, f"policy fields missing from the Policies page: {missing + tls}"


def test_every_error_code_says_what_a_caller_does() -> None:
    page = (DOCS / "reference" / "errors.md").read_text()
    missing = [
        f"{cls.status} {code}"
        for code, cls in BY_CODE.items()
        if f"| {cls.status} | `{code}` |" not in page
    ]
    assert not missing, f"error codes missing from docs/reference/errors.md: {missing}"


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"[`*]|\[|\]\([^)]*\)", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {_github_anchor(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}


def test_the_readme_links_hold() -> None:
    """The README is read on its own (not in the site), so its links are checked here: every
    relative link names a file of the repository, and every anchor a heading of its page."""
    readme = REPO_ROOT / "README.md"
    prose = re.sub(r"^```.*?^```", "", readme.read_text(), flags=re.M | re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto:, …
        path, _, anchor = target.partition("#")
        page = (REPO_ROOT / path) if path else readme
        missing_anchor = anchor and page.suffix == ".md" and anchor not in _anchors(page)
        if not page.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"README.md links to what does not exist: {broken}"
