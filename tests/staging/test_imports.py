"""No import cycles among dtrain.staging modules, counting imports inside functions too (a lazy
import closes a cycle as surely as a top-level one; engine <-> remote was one)."""

from __future__ import annotations

import ast
import pathlib

import dtrain.staging

PACKAGE = "dtrain.staging"


def module_names(package_dir: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    return {(package if p.stem == "__init__" else f"{package}.{p.stem}"): p for p in sorted(package_dir.glob("*.py"))}


def imported(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The ``modules`` that import statements anywhere in ``tree`` (functions included) load.

    ``from pkg import mod`` loads ``mod``; ``from pkg.mod import name`` loads ``pkg.mod``."""
    here = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x / from .x import y
                parts = here.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return out & modules


def import_graph(package_dir: pathlib.Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (anywhere in its source)."""
    modules = module_names(package_dir, package)
    return {name: imported(ast.parse(path.read_text(), str(path)), name, path.stem == "__init__", set(modules))
            - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_among_staging_modules():
    graph = import_graph(pathlib.Path(dtrain.staging.__file__).parent, PACKAGE)
    # The walk sees top-level and function-level imports (or this test would prove nothing).
    assert f"{PACKAGE}.copy" in graph[f"{PACKAGE}.engine"]
    assert f"{PACKAGE}.s3http" in graph[f"{PACKAGE}.sources"]  # imported inside functions only
    assert cycles(graph) == []


def test_the_check_finds_a_cycle_closed_by_a_lazy_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("def stage():\n    from pkg.remote import copy\n    return copy\n")
    (pkg / "remote.py").write_text("def copy():\n    from . import engine\n    return engine\n")
    (pkg / "leaf.py").write_text("import pkg.engine\n")
    assert cycles(import_graph(pkg, "pkg")) == [["pkg.engine", "pkg.remote"]]
