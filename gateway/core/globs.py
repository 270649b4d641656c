"""Resource globs: `*` matches within one segment, `**` across segments."""

from __future__ import annotations

import re
from functools import lru_cache

from gateway.core.grammar import valid_resource


@lru_cache(maxsize=1024)
def compile_glob(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(\*\*|\*)", pattern)
    regex = "".join(
        ".*" if part == "**" else "[^/]*" if part == "*" else re.escape(part) for part in parts
    )
    return re.compile(regex)


def valid_glob(pattern: str) -> bool:
    """A glob is a resource whose segments may hold `*` or `**`."""
    return valid_resource(pattern.replace("**", "x").replace("*", "x"))


def glob_matches(pattern: str, resource: str) -> bool:
    return compile_glob(pattern).fullmatch(resource) is not None
