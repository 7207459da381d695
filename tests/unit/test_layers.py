"""The code's shape, kept: no import cycle in ``ddp_core`` or ``jobs`` (imports inside functions count), and no
module imports another module's private name. ``lint-imports`` (pyproject.toml) keeps the layers."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

from tests.support.helpers import ROOT


def cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in modules:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in modules:
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    graph = grimp.build_graph("ddp_core", "jobs")
    assert cycles(graph, "ddp_core") == []
    assert cycles(graph, "jobs") == []


def test_the_cycle_finder_finds_one():
    """The check above can fail: a two-module cycle is found."""
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert cycles(graph, "p") == [["p.a", "p.b"]]


def private_imports(path: Path) -> list[str]:
    """``from ddp_core.x import _name`` / ``from jobs.x import _name`` in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("ddp_core", "jobs"):
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {alias.name}" for alias in node.names
                      if alias.name.startswith("_")]  # fmt: skip
    return found


def test_no_module_imports_a_private_name_of_another():
    files = sorted((ROOT / "ddp_core").rglob("*.py")) + sorted((ROOT / "jobs").rglob("*.py"))
    assert [hit for path in files for hit in private_imports(path)] == []
