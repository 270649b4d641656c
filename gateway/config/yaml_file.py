"""YAML configuration files validated into pydantic models, with errors that name the file,
the line and the field (`policies/a.yaml:14: resources[2].lease.ttl_s: 0 is not > 0`).

YAML is composed into nodes first so that a pydantic error location can be traced back to the
line it came from. A key written twice in one mapping is an error: plain YAML loading keeps the
last one silently, so a second `url:` or `fenced_methods:` would quietly undo the first. Policy
files and the clients file both load through here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

Model = TypeVar("Model", bound=BaseModel)
_MERGE_TAG = "tag:yaml.org,2002:merge"


class ConfigFileError(Exception):
    """A configuration file is unusable; the message is `file:line: field: problem`."""


class DuplicateKeyError(yaml.YAMLError):
    """A mapping holds the same key twice; `mark` is where the second one starts."""

    def __init__(self, key: Any, mark: yaml.Mark, first: yaml.Mark) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.mark, self.first = key, mark, first


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping.

    The check runs as each mapping is composed, on the keys as written: by construction
    time a `<<` merge may already have copied another mapping's keys into it (PyYAML flattens
    merged mappings in place), and overriding a merged key is what a merge is for.
    """

    # types-PyYAML declares `anchor` as a dict of nodes; PyYAML passes the anchor's name (a
    # str, or None when the mapping has no `&anchor`) and uses it as a key of `self.anchors`.
    def compose_mapping_node(self, anchor: str | None) -> yaml.MappingNode:  # type: ignore[override]
        node = super().compose_mapping_node(anchor)  # type: ignore[arg-type]
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue  # a non-scalar key is refused by the schema anyway
            key = self.construct_object(key_node)  # so `1` and `0x1`, `on` and `true` clash
            if key in seen:
                raise DuplicateKeyError(key, key_node.start_mark, seen[key])
            seen[key] = key_node.start_mark
        return node


class YamlFile:
    """One parsed YAML file: its data, and the line of any location in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.document, self._root = _parse(path)

    def validate(self, model: type[Model]) -> Model:
        try:
            return model.model_validate(self.document)
        except ValidationError as exc:
            error = exc.errors()[0]
            loc = error["loc"]
            raise self.error(loc, _describe(error)) from None

    def where(self, *loc: Any) -> str:
        return f"{self.path}:{_line_of(self._root, loc)}"

    def error(self, loc: tuple[Any, ...], problem: str) -> ConfigFileError:
        return ConfigFileError(f"{self.where(*loc)}: {_dotted(loc)}: {problem}")


def _parse(file: Path) -> tuple[Any, yaml.Node | None]:
    try:
        text = file.read_text(encoding="utf-8")
        # Composed apart from the data: constructing flattens `<<` merges into the nodes.
        root = yaml.compose(text, Loader=_StrictLoader)
        document = yaml.load(text, Loader=_StrictLoader)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{file}: cannot read: {exc}") from None
    except RecursionError:  # PyYAML composes and constructs recursively
        raise ConfigFileError(f"{file}: not valid YAML: nested too deeply") from None
    except DuplicateKeyError as exc:
        raise ConfigFileError(
            f"{file}:{exc.mark.line + 1}: duplicate key {exc.key!r} (first "
            f"at line {exc.first.line + 1})"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        raise ConfigFileError(
            f"{file}:{line}: not valid YAML: {getattr(exc, 'problem', exc)}"
        ) from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise ConfigFileError(
            f"{file}:1: the top level must be a mapping with upstreams and resources"
        )
    return document, root


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int:
    """The line of the deepest YAML node that `loc` reaches (1-based)."""
    line = node.start_mark.line + 1 if node is not None else 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == part), None)
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            node = node.value[part]
        else:
            break
        if node is None:
            break
        line = node.start_mark.line + 1
    return line


def _dotted(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "(top level)"


def _describe(error: ErrorDetails) -> str:
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return "unknown field"
    if "input" in error and not isinstance(error["input"], dict | list):
        return f"{error['input']!r}: {message}"
    return message
