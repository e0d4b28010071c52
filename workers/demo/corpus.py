"""The demo model's training text: docstrings of stdlib modules that ship with every Python.

Deterministic for a given Python version: a fixed list of modules, walked in source order.
Besides plain docstrings it yields a few chat-shaped samples ("What does X do?" answered by the
first paragraph of X's docstring) so the model has seen its chat template.
"""

from __future__ import annotations

import ast
import codecs
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

STDLIB_MODULES = (
    "textwrap", "argparse", "collections/__init__", "json/__init__", "functools", "itertools",
    "string", "random", "statistics", "fractions", "heapq", "bisect", "contextlib",
    "dataclasses", "enum", "shutil", "tempfile", "logging/__init__", "calendar", "datetime",
    "difflib", "pprint", "queue", "threading", "subprocess", "csv", "inspect", "typing", "abc",
    "copy", "fnmatch", "glob", "gettext", "locale", "optparse", "pathlib", "zipfile",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Docstring:
    qualname: str  # e.g. "textwrap.dedent"
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_docstrings(modules: tuple[str, ...] = STDLIB_MODULES) -> Iterator[Docstring]:
    """Module, class and function docstrings of ``modules`` (missing modules are skipped)."""
    root = stdlib_dir()
    for module in modules:
        path = root / f"{module}.py"
        if not path.is_file():
            continue
        name = module.removesuffix("/__init__").replace("/", ".")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        yield from _walk(tree, name)


def _walk(node: ast.AST, qualname: str) -> Iterator[Docstring]:
    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        doc = ast.get_docstring(node)
        if doc and len(doc) > 20:
            yield Docstring(qualname, doc)
    for child in ast.iter_child_nodes(node):
        match child:
            case (
                ast.ClassDef(name=name)
                | ast.FunctionDef(name=name)
                | ast.AsyncFunctionDef(name=name)
            ) if not name.startswith("_"):
                yield from _walk(child, f"{qualname}.{name}")


def zen_of_python() -> str:
    """``this.py`` keeps the Zen of Python rot13-encoded; decode it without importing it."""
    path = stdlib_dir() / "this.py"
    if not path.is_file():
        return ""
    source = path.read_text(encoding="utf-8")
    start, end = source.find('"""'), source.rfind('"""')
    return codecs.decode(source[start + 3 : end], "rot13") if 0 <= start < end else ""


def first_paragraph(text: str) -> str:
    return text.strip().split("\n\n", 1)[0].replace("\n", " ").strip()
