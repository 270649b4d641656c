"""How the examples test reads a page: blocks, markers, included files, README twins."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import MarkerError, blocks_of
from tests.docs.test_examples import page_blocks


def page(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_blocks_and_their_markers(tmp_path: Path) -> None:
    text = (
        "# Page\n\n<!-- not-run: needs a cluster -->\n```sh\nkubectl apply\n```\n\n"
        "<!-- run: background port=9400 -->\n```sh\nserve\n```\n\n"
        "```python\nprint(1)\n```\n<!-- output -->\n```text\n1\n```\n\n"
        "<!-- an ordinary comment -->\n```yaml\na: 1\n```\n\n"
        "* a list item:\n\n  ```bash\n  echo indented\n  ```\n\n```ruby\nputs 1\n```\n"
        "\n<!-- run-by: tests/recipes/test_recipes.py -->\n```python\nprint(2)\n```\n"
    )
    found = blocks_of(page(tmp_path, "p.md", text), tmp_path)
    assert [(b.kind, b.line) for b in found] == [
        ("not-run", 4),
        ("shell", 9),
        ("python", 13),
        ("output", 17),
        ("yaml", 22),
        ("shell", 28),
        ("unknown", 32),
        ("run-by", 37),
    ]
    assert found[7].run_by == "tests/recipes/test_recipes.py"
    assert found[0].not_run == "needs a cluster"
    assert found[1].background_port == 9400
    assert found[5].text == "echo indented\n"


def test_a_marker_the_convention_does_not_know_is_an_error(tmp_path: Path) -> None:
    unknown = (
        "<!-- not-run -->",
        "<!-- run: later -->",
        "<!-- output: maybe -->",
        "<!-- run-by -->",
    )
    for marker in unknown:
        with pytest.raises(MarkerError):
            blocks_of(page(tmp_path, "p.md", f"{marker}\n```sh\ntrue\n```\n"), tmp_path)


def test_an_included_file_is_the_block_s_text(tmp_path: Path) -> None:
    page(tmp_path, "policies/a.yaml", "upstreams: []\n")
    found = blocks_of(page(tmp_path, "p.md", '```yaml\n--8<-- "policies/a.yaml"\n```\n'), tmp_path)
    assert found[0].text == "upstreams: []\n"


def test_a_readme_block_a_docs_page_has_is_that_page_s(tmp_path: Path) -> None:
    shared, own = "```sh\nmake run\n```\n", "```sh\necho readme only\n```\n"
    readme = page(tmp_path, "README.md", shared + own)
    docs = page(tmp_path, "docs/install.md", "<!-- not-run: serves -->\n" + shared)
    found = page_blocks([readme, docs], tmp_path)
    assert [b.text for b in found["README.md"]] == ["echo readme only\n"]
    assert found["docs/install.md"][0].not_run == "serves"
