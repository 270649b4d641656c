"""The fenced code blocks of a Markdown page, with the marker written just before each.

A marker is an HTML comment on the last non-blank line before the opening fence (see the
convention in tests/docs/test_examples.py):

    <!-- not-run: REASON -->          not run, for REASON (required)
    <!-- run: background port=N -->  started in the background; the next blocks wait for N
    <!-- output -->                   the exact output of the block run just before
    <!-- run-by: PATH -->             run by the test at PATH (a file of the repository)
                                      instead, which reads the block from the page

A line `--8<-- "PATH"` inside a block is the file at PATH (from the repository's root), as
the site's snippets extension includes it: a page shows a shipped file without a copy of it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

# How each language is treated; any other language is an error unless the block is marked.
RUN = frozenset({"python", "py", "sh", "bash", "shell", "console"})
CHECK = frozenset({"yaml", "yml"})
# What is shown, not run: program output, answers, diagrams.
SHOW = frozenset({"", "text", "json"})

_FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,})(?P<lang>[\w+-]*)[^`]*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<body>.*?)\s*-->\s*$")
_NOT_RUN = re.compile(r"^not-run:\s*(?P<reason>\S.*)$")
_BACKGROUND = re.compile(r"^run:\s*background\s+port=(?P<port>\d+)$")
_RUN_BY = re.compile(r"^run-by:\s*(?P<path>\S+)$")
_SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$', re.M)


class MarkerError(ValueError):
    """A marker the convention does not know, or a not-run marker without a reason."""


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # the page's path, relative to the repository
    line: int  # the opening fence's line, 1-based
    lang: str
    text: str
    not_run: str | None = None  # the reason, when marked not-run
    background_port: int | None = None
    is_output: bool = False
    run_by: str | None = None  # the test that runs it instead, when marked run-by

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        """ "not-run", "run-by", "output", "yaml", "python", "shell", "show" or "unknown"."""
        if self.not_run is not None:
            return "not-run"
        if self.run_by is not None:
            return "run-by"
        if self.is_output:
            return "output"
        if self.lang in CHECK:
            return "yaml"
        if self.lang in ("python", "py"):
            return "python"
        if self.lang in RUN:
            return "shell"
        return "show" if self.lang in SHOW else "unknown"


def blocks_of(path: Path, root: Path) -> list[Block]:
    """Every fenced block of the page at `path`, in order, with its marker read."""
    lines = path.read_text().split("\n")
    page = str(path.relative_to(root))
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, ticks = opening["indent"], opening["ticks"]
        end = index + 1
        while end < len(lines) and not re.match(rf"^ *{ticks}\s*$", lines[end]):
            end += 1
        body = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end])
        body = _SNIPPET.sub(lambda m: (root / m["path"]).read_text().rstrip("\n"), body)
        found.append(_marked(page, index + 1, opening["lang"].lower(), body + "\n", lines[:index]))
        index = end + 1
    return found


def _marked(page: str, line: int, lang: str, text: str, before: list[str]) -> Block:
    previous = next((entry for entry in reversed(before) if entry.strip()), "")
    marker = _MARKER.match(previous)
    if marker is None:
        return Block(page, line, lang, text)
    body = marker["body"]
    if not_run := _NOT_RUN.match(body):
        return Block(page, line, lang, text, not_run=not_run["reason"])
    if background := _BACKGROUND.match(body):
        return Block(page, line, lang, text, background_port=int(background["port"]))
    if body == "output":
        return Block(page, line, lang, text, is_output=True)
    if run_by := _RUN_BY.match(body):
        return Block(page, line, lang, text, run_by=run_by["path"])
    if body.startswith(("not-run", "run", "output")):
        raise MarkerError(f"{page}:{line}: a marker the convention does not know: {previous}")
    return Block(page, line, lang, text)  # another comment: not a marker
