"""Which part of the gateway may import which: the layers, read from the source with `ast`.

Top to bottom; a module imports only its own package and packages strictly lower:

    cli > server > console > api > upkeep > proxy > {config, observe, store, wire} > core

config, observe, store and wire are siblings and import none of each other. Outside the layers:
`gateway/__init__.py` imports nothing of the project (importing `gateway.client` runs it),
`gateway/__main__.py` imports only cli, and `gateway/client/`, what agents import, imports
nothing of the project but core and itself and is imported only by cli (the demo plays an
agent with it).

Every import statement counts, at module level or inside a function, and so do imports under
`if TYPE_CHECKING:`: an annotation that names an upper layer's class ties the lower layer to
it as surely as a runtime import does, and it becomes one the day the type is needed at run
time (an isinstance, a pydantic model). The cycle check, and only it, leaves those imports
out: they never run, so they cannot make an import cycle, and one that crosses packages is
already an upward import that the layer check reports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"

# Package -> rank; a module may import a package of strictly lower rank, or its own.
LAYERS = {
    "core": 0,
    "config": 1,
    "observe": 1,
    "store": 1,
    "wire": 1,
    "proxy": 2,
    "upkeep": 3,
    "api": 4,
    "console": 5,
    "server": 6,
    "cli": 7,
}
LAYER_ORDER = (
    "cli > server > console > api > upkeep > proxy > {config, observe, store, wire} > core"
)

# Modules directly under gateway/ that belong to no layer, and what each may import.
TOP_LEVEL: dict[str, frozenset[str]] = {
    "gateway": frozenset(),  # gateway/__init__.py
    "gateway.__main__": frozenset({"cli"}),
    "gateway.client": frozenset({"core", "client"}),
}
CLIENT = "client"  # the package gateway/client/, outside the layers
CLIENT_IMPORTS = frozenset({"core", CLIENT})
CLIENT_IMPORTERS = frozenset({"cli"})


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # the gateway module imported, as precisely as the source names it
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`


def module_names(root: Path) -> dict[str, Path]:
    """Every module under `root` (the `gateway` folder) by dotted name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(body: list[ast.AST], type_only: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every statement, at any depth, with whether it sits under `if TYPE_CHECKING:`."""
    for node in body:
        yield node, type_only
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(list(node.body), True)
            yield from _statements(list(node.orelse), type_only)
            continue
        # bodies of functions, classes, loops, with, try (and its handlers), match cases
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                yield from _statements(children, type_only)


def _resolve(known: set[str], name: str) -> str:
    """The most precise known module that `name` is, or lies in; `name` itself if none."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return name


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node, type_only in _statements(list(tree.body), False):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                # `from gateway.proxy import appkeys` imports the module gateway.proxy.appkeys
                submodule = f"{source}.{alias.name}"
                targets.append(submodule if submodule in known else source)
        else:
            continue
        for target in targets:
            if target == "gateway" or target.startswith("gateway."):
                found.append(Import(module, _resolve(known, target), node.lineno, type_only))
    return list(dict.fromkeys(found))  # `from m import a, b` is one import of m


def all_imports(root: Path) -> list[Import]:
    modules = module_names(root)
    known = set(modules)
    return [imp for name, path in modules.items() for imp in imports_of(name, path, known)]


def package_of(module: str) -> str | None:
    """The layer package a module is in (`gateway.proxy.relay` -> `proxy`); None at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def _where(imp: Import, root: Path) -> str:
    path = module_names(root).get(imp.importer)
    shown = path.relative_to(root.parent) if path else imp.importer
    kind = "imports (under TYPE_CHECKING)" if imp.type_only else "imports"
    return f"{shown}:{imp.line}: {imp.importer} {kind} {imp.target}"


def _broken_rule(imp: Import) -> str | None:
    """The rule `imp` breaks, or None."""
    source, target = package_of(imp.importer), package_of(imp.target)
    if source is None or source == CLIENT:  # outside the layers
        allowed = CLIENT_IMPORTS if source == CLIENT else TOP_LEVEL.get(imp.importer, frozenset())
        if target in allowed:
            return None
        return f"{imp.importer} may import {', '.join(sorted(allowed)) or 'nothing of the project'}"
    if imp.target == "gateway.client" or target == CLIENT:
        return (
            None
            if source in CLIENT_IMPORTERS
            else "gateway.client is the agents' side; "
            f"only {', '.join(sorted(CLIENT_IMPORTERS))} may import it"
        )
    if imp.target == "gateway":
        return None  # the package itself, which imports nothing
    if target not in LAYERS:
        return f"{imp.target} is in no layer"
    if source not in LAYERS or source == target:
        return None  # a module in no layer is test_every_module_is_in_a_layer's to report
    if LAYERS[target] == LAYERS[source]:
        return (
            f"{source} and {target} are siblings (config, observe, store, wire): neither may "
            "import the other"
        )
    if LAYERS[target] > LAYERS[source]:
        return f"{source} may not import {target}, a higher layer"
    return None


def layer_violations(root: Path) -> list[str]:
    return [
        f"{_where(imp, root)}: {rule}"
        for imp in all_imports(root)
        if (rule := _broken_rule(imp)) is not None
    ]


def import_cycles(root: Path) -> list[list[Import]]:
    """Each cycle of run-time imports between modules, as the imports that close it."""
    graph: dict[str, list[Import]] = {}
    for imp in all_imports(root):
        if not imp.type_only and imp.target != imp.importer:
            graph.setdefault(imp.importer, []).append(imp)
    cycles: list[list[Import]] = []
    seen: set[frozenset[str]] = set()
    state: dict[str, str] = {}  # "open" while on the DFS path, "done" after
    path: list[Import] = []

    def visit(module: str) -> None:
        state[module] = "open"
        for imp in graph.get(module, []):
            if state.get(imp.target) == "open":
                start = next(i for i, step in enumerate(path) if step.importer == imp.target)
                cycle = [*path[start:], imp]
                members = frozenset(step.importer for step in cycle)
                if members not in seen:
                    seen.add(members)
                    cycles.append(cycle)
            elif imp.target not in state:
                path.append(imp)
                visit(imp.target)
                path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def stray_modules(root: Path) -> list[str]:
    """Modules in no layer package and not one of the few allowed at the top."""
    return [
        f"{path.relative_to(root.parent)}: {name} is in no layer package "
        f"({', '.join(LAYERS)}) and is not one of {', '.join(sorted(TOP_LEVEL))}"
        for name, path in module_names(root).items()
        if package_of(name) not in {*LAYERS, CLIENT} and name not in TOP_LEVEL
    ]


def _cycle_message(cycle: list[Import], root: Path) -> str:
    chain = " -> ".join([*(step.importer for step in cycle), cycle[-1].target])
    steps = "\n    ".join(_where(step, root) for step in cycle)
    return f"import cycle {chain}:\n    {steps}"


# The gateway itself.


def test_imports_follow_the_layers() -> None:
    problems = layer_violations(GATEWAY)
    assert not problems, f"imports against the layers ({LAYER_ORDER}):\n" + "\n".join(problems)


def test_no_import_cycles() -> None:
    cycles = import_cycles(GATEWAY)
    assert not cycles, "\n".join(_cycle_message(c, GATEWAY) for c in cycles)


def test_every_module_is_in_a_layer() -> None:
    strays = stray_modules(GATEWAY)
    assert not strays, "\n".join(strays)


# The checks themselves, on small trees made for them: each must see what it is for.


def _tree(root: Path, files: dict[str, str]) -> Path:
    gateway = root / "gateway"
    for name, text in {"__init__.py": "", **files}.items():
        (gateway / name).parent.mkdir(parents=True, exist_ok=True)
        (gateway / name).write_text(text, encoding="utf-8")
    for package in LAYERS:
        (gateway / package).mkdir(exist_ok=True)
        (gateway / package / "__init__.py").touch()
    return gateway


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {
                "core/a.py": "import os\n\ndef f():\n    from gateway.proxy import b\n",
                "proxy/b.py": "",
            },
            "gateway/core/a.py:4: gateway.core.a imports gateway.proxy.b: "
            "core may not import proxy",
        ),
        (
            {
                "store/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from gateway.observe.logs import x\n",
                "observe/logs.py": "",
            },
            "gateway/store/a.py:3: gateway.store.a imports (under TYPE_CHECKING) "
            "gateway.observe.logs: store and observe are siblings",
        ),
        (
            {"proxy/a.py": "from ..server import app\n", "server/app.py": ""},
            "gateway/proxy/a.py:1: gateway.proxy.a imports gateway.server.app: "
            "proxy may not import",
        ),
        (
            {"client.py": "import gateway.config.settings\n", "config/settings.py": ""},
            "gateway/client.py:1: gateway.client imports gateway.config.settings: gateway.client "
            "may import client, core",
        ),
        (
            {"server/a.py": "from gateway import client\n", "client.py": ""},
            "gateway/server/a.py:1: gateway.server.a imports gateway.client: gateway.client is the "
            "agents' side",
        ),
        (
            {"client/aio.py": "from gateway.store import base\n", "store/base.py": ""},
            "gateway/client/aio.py:1: gateway.client.aio imports gateway.store.base: "
            "gateway.client.aio may import client, core",
        ),
    ],
    ids=[
        "upward-in-a-function",
        "sibling-type-only",
        "upward-relative",
        "client-imports-config",
        "server-imports-client",
        "client-module-imports-store",
    ],
)
def test_layer_check_reports_the_module_line_and_rule(
    tmp_path: Path, files: dict[str, str], expected: str
) -> None:
    problems = layer_violations(_tree(tmp_path, files))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_layer_check_accepts_downward_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "core/a.py": "",
            "store/b.py": "from gateway.core import a\nfrom . import c\n",
            "store/c.py": "",
            "cli/d.py": "from gateway.client import x\nfrom gateway.store.b import y\n",
            "client.py": "from gateway.core.a import z\n",
            "__main__.py": "from gateway.cli.d import main\n",
        },
    )
    assert layer_violations(root) == []


def test_cycle_check_reports_the_path(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "proxy/a.py": "from gateway.proxy import b, d\n",
            "proxy/b.py": "import os\n\ndef f():\n    from gateway.proxy.c import x\n",
            "proxy/c.py": "from .a import y\n",
            # a type-only import back to a: no cycle at run time
            "proxy/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from gateway.proxy.a import z\n",
        },
    )
    cycles = import_cycles(root)
    assert len(cycles) == 1, cycles
    message = _cycle_message(cycles[0], root)
    assert message.startswith(
        "import cycle gateway.proxy.a -> gateway.proxy.b -> gateway.proxy.c -> gateway.proxy.a"
    )
    assert "gateway/proxy/b.py:4: gateway.proxy.b imports gateway.proxy.c" in message


def test_stray_check_names_a_module_outside_the_layers(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"helpers.py": "", "misc/thing.py": "", "client.py": ""})
    assert [s.split(":")[0] for s in stray_modules(root)] == [
        "gateway/helpers.py",
        "gateway/misc/thing.py",
    ]
