"""Imports flow one way: the layer order written in docs/architecture.md, and no cycles."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "paratrain"


def layers(heading: str = "Layers") -> list[set[str]]:
    """The numbered list under '## <heading>' in docs/architecture.md, top first; each item
    names one or more top-level modules or packages of paratrain (peers), or rooms of a
    package (``engine.run``)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    found = []
    for line in section.splitlines():
        match = re.match(r"^\d+\. `([^`]+)`", line)
        if match:
            found.append({name.strip() for name in match[1].split(",")})
    return found


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("paratrain", *path.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of import nodes inside ``if TYPE_CHECKING:`` blocks (annotations only)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            found |= {id(inner) for inner in ast.walk(node)}
    return found


def imports(known: dict[str, Path], runtime_only: bool = False) -> dict[str, set[str]]:
    """Every import of a paratrain module by another, including those inside functions,
    resolved to the longest module that exists; ``runtime_only``: not those made for
    type annotations alone (``if TYPE_CHECKING:``), which run nothing."""

    def resolve(target: str) -> str | None:
        parts = target.split(".")
        while parts:
            if ".".join(parts) in known:
                return ".".join(parts)
            parts.pop()
        return None

    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        skipped = _type_only(tree) if runtime_only else set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets = []
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("paratrain")
            ):
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("paratrain")]
            for target in targets:
                resolved = resolve(target)
                if resolved and resolved != name:
                    graph[name].add(resolved)
    return graph


def unit(module: str) -> str:
    """The top-level module or package a module belongs to ('paratrain' for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else "paratrain"


def test_the_layer_list_names_every_top_level_module():
    named = set().union(*layers())
    present = {unit(m) for m in modules()}
    assert named == present, (
        f"not in docs/architecture.md: {present - named}; gone: {named - present}"
    )


def test_every_import_goes_down_the_layers():
    order = {name: index for index, group in enumerate(layers()) for name in group}
    wrong = []
    for importer, targets in imports(modules()).items():
        for target in targets:
            a, b = unit(importer), unit(target)
            if a == b:
                continue
            if order[b] <= order[a]:  # above, or a peer in the same layer
                wrong.append(
                    f"{importer} imports {target} ({a} is layer {order[a] + 1}, {b} {order[b] + 1})"
                )
    assert not wrong, "\n".join(sorted(wrong))


def room(module: str) -> str:
    """The room of engine/ a module of it is in: ``engine.<room>`` (a subpackage or a
    module directly under engine/)."""
    return "engine." + module.split(".")[2] if module.count(".") >= 2 else "engine"


def test_the_rooms_of_engine_are_named_and_every_import_between_them_goes_down():
    order = {name: index for index, group in enumerate(layers("Rooms of engine")) for name in group}
    present = {room(m) for m in modules() if m.startswith("paratrain.engine.")}
    assert set(order) == present, f"unlisted rooms: {present - set(order)}"
    wrong = []
    for importer, targets in imports(modules()).items():
        if not importer.startswith("paratrain.engine."):
            continue
        for target in targets:
            if not target.startswith("paratrain.engine."):
                continue
            a, b = room(importer), room(target)
            if a != b and order[b] <= order[a]:
                wrong.append(f"{importer} imports {target}: {b} is not below {a}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_imports_itself_around_a_cycle():
    graph = imports(modules())  # annotations-only imports too: no cycle of any kind
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in list(modules()):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_no_module_over_600_lines_and_no_function_over_60():
    """Rooms stay small enough to read: a module that grows past 600 lines, or a function
    past 60, is split (docs/architecture.md says where each piece goes)."""
    long_modules, long_functions = [], []
    for name, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 600:
            long_modules.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > 60:
                    long_functions.append(f"{name}.{node.name}: {length} lines")
    assert not long_modules and not long_functions, "\n".join(long_modules + long_functions)
