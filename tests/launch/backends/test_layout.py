"""The backend boundary, checked statically: outside ``launch/backends/<name>/`` no code compares a
backend name or imports a backend's folder (only the registry names them), and the launch
package has no import cycle. This is what keeps a new backend a one-folder change."""

from __future__ import annotations

import ast
import os
import sys

import pytest

from tests.import_scan import runtime_nodes

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                       "operators", "dtrain")
BACKENDS = ("local", "ssh", "slurm", "mpi")
REGISTRY = os.path.join("launch", "backends", "__init__.py")


def modules():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield os.path.relpath(path, PACKAGE), ast.parse(open(path, encoding="utf-8").read(), path)


def owner(relpath: str) -> str | None:
    """The backend whose folder holds ``relpath`` (None outside every backend folder)."""
    parts = relpath.split(os.sep)
    return parts[2] if parts[:2] == ["launch", "backends"] and len(parts) > 3 else None


def imported_backend(module: str) -> str | None:
    parts = module.split(".")
    return parts[3] if parts[:3] == ["dtrain", "launch", "backends"] and len(parts) > 3 else None


def _mentions_backend(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return "backend" in text.lower()


def violations() -> list[str]:
    found = []
    for rel, tree in modules():
        here = owner(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                names = []
            for name in names:
                target = imported_backend(name)
                if target in BACKENDS and target != here and rel != REGISTRY:
                    found.append(f"{rel}:{node.lineno} imports backend {target!r} ({name})")
            if isinstance(node, ast.Compare) and here is None:
                sides = [node.left, *node.comparators]
                constants = [s.value for s in sides if isinstance(s, ast.Constant)]
                constants += [e.value for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set))
                              for e in s.elts if isinstance(e, ast.Constant)]
                if set(constants) & set(BACKENDS) and any(_mentions_backend(s) for s in sides):
                    found.append(f"{rel}:{node.lineno} compares a backend name: {ast.unparse(node)}")
    return found


def test_no_backend_name_or_folder_outside_its_folder():
    assert violations() == []


def test_the_check_catches_what_it_forbids(tmp_path, monkeypatch):
    """The scan is not vacuous: a planted branch and a planted import are both reported."""
    bad = tmp_path / "dtrain"
    (bad / "launch").mkdir(parents=True)
    (bad / "launch" / "x.py").write_text("from dtrain.launch.backends.slurm import render\n"
                                         "def f(spec):\n    return spec.backend == 'slurm'\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(bad))
    assert sorted({v.split()[0] for v in violations()}) == ["launch/x.py:1", "launch/x.py:3"]


def import_graph(prefix: str) -> dict[str, set[str]]:
    """module -> the package modules it imports, at module level or inside functions."""
    graph: dict[str, set[str]] = {}
    for rel, tree in modules():
        name = "dtrain." + rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        if not name.startswith(prefix):
            continue
        deps = set()
        for node in runtime_nodes(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


@pytest.mark.parametrize("prefix", ["dtrain.launch", "dtrain"])
def test_no_import_cycle(prefix):
    """Function-level imports count too: a cycle hidden in a lazy import is still a cycle
    (the old spec <-> hostfile one was). A package's __init__ re-exporting its own modules
    is not a cycle of modules, so edges into a package __init__ from its own children are skipped."""
    graph = import_graph(prefix)
    for module, deps in graph.items():
        graph[module] = {d for d in deps if not module.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            pytest.fail(" -> ".join(cycle))
