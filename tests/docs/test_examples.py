"""Every example in README.md and docs/**/*.md runs, or says why it does not.

The convention, by the fenced block's language:

* `yaml`: a policy file, checked with `fence-gateway check-policies` (each `${VAR}` it reads
  set to a stand-in value); a block whose top key is `clients` is a clients file, loaded as
  the gateway loads `GATEWAY_CLIENTS` (a `key_sha256: "<…>"` placeholder filled with a hash).
* `python`: run as a script (named by a first line `# name.py`, if it has one).
* `sh`, `bash`, `shell`: run with `bash -e -o pipefail` from the repository's root;
  `console`: the lines after `$ ` are run so.
* `text`, `json`, or no language: output, answers and diagrams, shown and not run.
* Anything else fails, unless marked.

The Python and shell blocks of a page run in page order, inside a network namespace of their
own (tests/docs/sandbox.py). When one of them talks to the gateway (it names `:8080`, or runs
`fence-gateway receipts`, `leases` or `fences`, which default to it), a gateway is started
first as `make run` starts it: the shipped `policies/` at 127.0.0.1:8080, on a fresh SQLite
database. So an example is written exactly as a reader runs it, next to `make run`. A page
that starts `chromium` needs Debian's Chromium (outside CI, without it, the page is skipped).

A marker is an HTML comment on the line just before the opening fence:

    <!-- not-run: REASON -->          not run, for REASON (a block that serves forever, needs
                                      a Kubernetes cluster, writes outside the repository…)
    <!-- run: background port=N -->  started in the background and left running until the
                                      page ends; the next block waits until N answers
    <!-- output -->                   a `text` block that is the exact output of the block run
                                      just before it
    <!-- run-by: PATH -->             run by the test module at PATH instead, which reads the
                                      block from the page itself

A README block whose text is also a block of a docs page is that page's to run (the README
shows a few of the site's examples); any other README block is run here like a page's.

`run-by` is for examples that need more around them than a page's sandbox gives: the agent
framework recipes (docs/guides/agent-frameworks.md) need a recording tool and a real MCP
server behind the shipped policies, a virtualenv of their own for LangChain, and checks of
what reached the tools, which tests/recipes/ has. So that test owns them and reads them from
the page, exactly as written; this one runs nothing of theirs, and checks only that the test
the marker names exists. One owner per block: nothing is run twice, and the two cannot
disagree about how a block runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from gateway.cli.main import main as fence_gateway
from gateway.config.clients import load_clients
from tests.docs.blocks import Block, blocks_of
from tests.harness import REPO_ROOT
from tests.sessions.chromium import chromium_path

DOCS = REPO_ROOT / "docs"
PAGES = [REPO_ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
SANDBOX_TIMEOUT_S = 300


def page_blocks(pages: list[Path], root: Path = REPO_ROOT) -> dict[str, list[Block]]:
    """The blocks of every page, less the README's that a docs page has too."""
    found = {str(page.relative_to(root)): blocks_of(page, root) for page in pages}
    in_docs = {b.text for name, blocks in found.items() if name != "README.md" for b in blocks}
    if "README.md" in found:
        found["README.md"] = [b for b in found["README.md"] if b.text not in in_docs]
    return found


BLOCKS = page_blocks(PAGES)


@pytest.mark.parametrize("page", sorted(BLOCKS))
def test_every_block_is_run_or_marked(page: str) -> None:
    unknown = [b.where + f" ({b.lang})" for b in BLOCKS[page] if b.kind == "unknown"]
    assert not unknown, f"blocks in a language the test does not run, and unmarked: {unknown}"
    ownerless = [b.where for b in BLOCKS[page] if b.run_by and not (REPO_ROOT / b.run_by).is_file()]
    assert not ownerless, f"blocks marked run-by a test that does not exist: {ownerless}"
    for index, block in enumerate(BLOCKS[page]):
        if block.kind == "output":
            runs = BLOCKS[page][index - 1].kind if index else None
            assert runs in ("python", "shell"), f"{block.where}: output of no block run"


YAML_BLOCKS = [b for blocks in BLOCKS.values() for b in blocks if b.kind == "yaml"]


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[b.where for b in YAML_BLOCKS])
def test_yaml_block_is_valid(
    block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    document = yaml.safe_load(block.text)
    file = tmp_path / "example.yaml"
    if isinstance(document, dict) and "clients" in document:
        file.write_text(re.sub(r'(key_sha256:\s*)"<[^>"]*>"', r'\1"' + "0" * 64 + '"', block.text))
        load_clients(file)
        return
    file.write_text(block.text)
    for name in re.findall(r"\$\{(\w+)\}", block.text):
        monkeypatch.setenv(name, "stand-in")
    status = fence_gateway(["check-policies", str(file)])
    assert status == 0, f"{block.where}: {capsys.readouterr().err}"


RUN_PAGES = sorted(
    p for p, blocks in BLOCKS.items() if any(b.kind in ("python", "shell") for b in blocks)
)
TALKS_TO_GATEWAY = re.compile(r":8080\b|fence-gateway (receipts|leases|fences)\b")
STARTS_CHROMIUM = re.compile(r"^\s*chromium\b", re.M)
# Pages run a few at a time, each in its own namespace: most of a page's time is waiting (a
# gateway starting, a lease expiring in the demo), so the suite waits for the slowest page
# rather than for all of them in turn.
AT_ONCE = 2
HAVE_CHROMIUM = shutil.which("chromium") is not None


def sandboxed() -> list[str]:
    """`unshare` into a network namespace of our own (as root, or as a mapped root)."""
    if os.geteuid() == 0:
        return ["unshare", "--net"]
    return ["unshare", "--user", "--map-root-user", "--net"]


def page_runs(page: str) -> list[dict[str, object]]:
    """The blocks of a page the sandbox runs, each with the output the page says it prints."""
    blocks = BLOCKS[page]
    runs: list[dict[str, object]] = []
    for index, block in enumerate(blocks):
        if block.kind not in ("python", "shell"):
            continue
        following = blocks[index + 1] if index + 1 < len(blocks) else None
        expect = following.text if following is not None and following.kind == "output" else None
        runs.append(
            {
                "where": block.where,
                "kind": block.kind,
                "lang": block.lang,
                "text": block.text,
                "port": block.background_port,
                "expect": expect,
            }
        )
    return runs


def run_page(page: str, workdir: Path) -> subprocess.CompletedProcess[bytes]:
    runs = page_runs(page)
    talks = any(TALKS_TO_GATEWAY.search(str(run["text"])) for run in runs)
    return subprocess.run(
        [*sandboxed(), sys.executable, "-m", "tests.docs.sandbox", str(workdir)],
        cwd=REPO_ROOT,
        input=json.dumps({"gateway": talks, "blocks": runs}).encode(),
        capture_output=True,
        timeout=SANDBOX_TIMEOUT_S,
    )


def needs_chromium(page: str) -> bool:
    return any(STARTS_CHROMIUM.search(str(run["text"])) for run in page_runs(page))


@pytest.fixture(scope="module")
def page_results(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Future[subprocess.CompletedProcess[bytes]]]]:
    """Every runnable page started at once (AT_ONCE at a time); each test waits for its own."""
    probe = subprocess.run([*sandboxed(), "true"], capture_output=True)
    if probe.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot make a network namespace: {probe.stderr.decode()}")
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.decode().strip()}")
    runnable = [p for p in RUN_PAGES if HAVE_CHROMIUM or not needs_chromium(p)]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        yield {
            page: pool.submit(run_page, page, tmp_path_factory.mktemp("page")) for page in runnable
        }


@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_examples_run(
    page: str, page_results: dict[str, Future[subprocess.CompletedProcess[bytes]]]
) -> None:
    if page not in page_results:
        chromium_path()  # fails under CI=true, skips with one line elsewhere
        pytest.skip("chromium is not on PATH")
    done = page_results[page].result()
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    failed = [f"{r['where']}:\n{r['output']}" for r in json.loads(done.stdout) if not r["ok"]]
    assert not failed, "examples that did not run:\n\n" + "\n\n".join(failed)
