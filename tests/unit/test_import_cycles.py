"""No import cycle between shoal's modules: the graph of every import statement (the lazy ones
inside functions and those under ``TYPE_CHECKING`` included, read with ``ast`` as the package
rules read them), where ``from package import name`` is an import of ``package.name`` when that
is a module, has no strongly connected component of more than one module.

A lazy import hides a cycle from Python but not from a reader: the two modules still cannot be
understood (or moved) one without the other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.unit.test_package_rules import FOLDERS, ROOT, module_name

Graph = dict[str, set[str]]


def shoal_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def imports_of(source: str, module: str, is_package: bool) -> Iterator[str]:
    """Every name an import statement of ``source`` may load: ``a.b`` for ``import a.b``;
    ``a`` and each ``a.x`` for ``from a import x``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*parent, base]) if base else ".".join(parent)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(modules: dict[str, Path]) -> Graph:
    graph: Graph = {}
    for module, path in modules.items():
        names = imports_of(path.read_text(), module, path.name == "__init__.py")
        graph[module] = {name for name in names if name in modules and name != module}
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back():
    found = cycles(import_graph(shoal_modules()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_walk_finds_a_cycle_through_a_lazy_import():
    sources = {
        "shoal.bus.a": "from shoal.bus.b import B\n",
        "shoal.bus.b": "def f():\n    from shoal.bus import c\n",
        "shoal.bus.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from shoal.bus.a import A\n",
        "shoal.bus.d": "from shoal.bus.a import A\n",
    }
    graph = {m: {n for n in imports_of(s, m, False) if n in sources} for m, s in sources.items()}
    assert cycles(graph) == [["shoal.bus.a", "shoal.bus.b", "shoal.bus.c"]]
