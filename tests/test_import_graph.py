"""No import cycle between dtrain's packages, and launch never reaches what is built on it.

Parsed, not imported: every module under operators/dtrain, with its imports anywhere in it (at
the top, inside a function or a method), except those under ``if TYPE_CHECKING:`` (they never
run). ``from x import y`` counts as an import of ``x.y`` when that is a module, else of ``x``;
relative imports are resolved against the importing module. Modules collapse to their package
(``dtrain.launch.core``, ``dtrain.launch.backends.ssh``, ``dtrain.training``...), a module directly
in ``dtrain`` (``dtrain.rundir``) being its own node; a subpackage is a node of its own, so a
module in it importing one of its parent package's is an edge like any other (the parent packages
Python runs first are not: only what the source names counts). A cycle between two packages means neither can
be understood, tested or loaded without the other: the check fails naming every edge of it (the
importing module and line), so the fix (moving the shared piece down) is plain from the message.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict
from dataclasses import dataclass

from tests.import_scan import runtime_nodes

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "operators")
PACKAGE = "dtrain"

#: (importing package prefix, imported package prefix, why it may not): the documented direction,
#: dtrain/launch/__init__.py (launch is below the packages built on it)
FORBIDDEN = (
    ("dtrain.launch", "dtrain.pipeline", "launch never reaches the pipeline (dtrain/launch/__init__.py)"),
    ("dtrain.launch", "dtrain.ui", "launch never reaches the UI (dtrain/launch/__init__.py)"),
)

#: Cycles that are known and owned elsewhere, each named by the packages on it (sorted) and why it is
#: tolerated for now. The check fails when a listed cycle is gone, so the entry goes with the fix.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


@dataclass(frozen=True)
class Edge:
    """One import statement between two packages."""

    source: str  # importing module
    line: int
    target: str  # imported module (or package)

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def modules(root: str = ROOT, package: str = PACKAGE) -> dict[str, tuple[str, bool]]:
    """Dotted name -> (path, is a package's __init__) for every module of ``package`` under ``root``."""
    found = {}
    for directory, dirs, files in os.walk(os.path.join(root, package)):
        dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(directory, d, "__init__.py")))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(directory, name), root)[:-3].replace(os.sep, ".")
            is_package = name == "__init__.py"
            found[rel.removesuffix(".__init__")] = (os.path.join(directory, name), is_package)
    return found


def imports_of(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for each import in ``tree``: ``from x import y`` gives ``x.y`` when that
    is a known module, else ``x``; relative imports resolved against ``module``."""
    found = []
    for node in runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.append((node.lineno, sub if sub in known else base))
    return sorted(set(found))


def package_of(module: str, packages: set[str]) -> str:
    """The node a module collapses to: its package, or itself for a module directly in dtrain (and
    for dtrain itself)."""
    if module in packages:
        return module
    parent = module.rpartition(".")[0]
    return module if parent == PACKAGE or not parent else parent


def package_graph(root: str = ROOT, package: str = PACKAGE) -> dict[str, dict[str, list[Edge]]]:
    """package -> imported package -> the import statements that make that edge (within dtrain)."""
    found = modules(root, package)
    known = set(found)
    packages = {name for name, (_, is_package) in found.items() if is_package}
    graph: dict[str, dict[str, list[Edge]]] = defaultdict(lambda: defaultdict(list))
    for module, (path, is_package) in sorted(found.items()):
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        source = package_of(module, packages)
        graph[source]  # every package is a node, importing or not
        for line, target in imports_of(tree, module, is_package, known):
            if target != package and not target.startswith(package + "."):
                continue
            while target not in known and "." in target:  # a name inside a module: that module
                target = target.rpartition(".")[0]
            dest = package_of(target, packages)
            if dest != source:
                graph[source][dest].append(Edge(module, line, target))
    return graph


def cycles(graph: dict[str, dict[str, object]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan's algorithm, iterative),
    each sorted; every import cycle lies inside one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    counter = 0
    nodes = sorted(set(graph) | {t for targets in graph.values() for t in targets})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def describe(component: list[str], graph: dict[str, dict[str, list[Edge]]]) -> str:
    """A cycle's packages and every import between them, by module and line."""
    lines = [" <-> ".join(component)]
    for source in component:
        for dest in component:
            for edge in graph.get(source, {}).get(dest, []):
                lines.append(f"    {source} -> {dest}: {edge}")
    return "\n".join(lines)


def cycle_report(graph) -> list[str]:
    return [describe(c, graph) for c in cycles(graph) if tuple(c) not in KNOWN_CYCLES]


def direction_report(graph) -> list[str]:
    def within(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    return [f"{edge} ({why})" for source, targets in sorted(graph.items()) for dest, edges in sorted(targets.items())
            for importer, imported, why in FORBIDDEN if within(source, importer) and within(dest, imported)
            for edge in edges]


def test_no_import_cycle_between_dtrain_packages():
    graph = package_graph()
    assert "dtrain.launch.engine" in graph and "dtrain.training" in graph  # the walk found the packages
    problems = cycle_report(graph)
    assert not problems, "import cycles between dtrain packages:\n" + "\n".join(problems)


def test_known_cycles_are_still_there():
    """A tolerated cycle that is gone leaves no stale exception behind."""
    present = {tuple(c) for c in cycles(package_graph())}
    assert set(KNOWN_CYCLES) <= present, f"fixed, remove from KNOWN_CYCLES: {set(KNOWN_CYCLES) - present}"


def test_launch_imports_nothing_built_on_it():
    problems = direction_report(package_graph())
    assert not problems, "\n".join(problems)


def test_cycle_finder_on_a_small_graph():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {"e": 1}, "e": {"d": 1}, "f": {"a": 1}}
    assert cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []


def _write(root, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """A planted cycle is found through a function-level import, a relative one and ``from pkg import
    submodule``; a TYPE_CHECKING import is not an edge; the message names the lines."""
    for package in ("dtrain", "dtrain/low", "dtrain/high", "dtrain/other"):
        _write(tmp_path, f"{package}/__init__.py")
    _write(tmp_path, "dtrain/low/a.py", "import os\n\ndef f():\n    from ..high import b\n")
    _write(tmp_path, "dtrain/high/b.py", "from dtrain.low import a\nfrom dtrain.rundir import X\n")
    _write(tmp_path, "dtrain/rundir.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from dtrain.other import c\n")
    _write(tmp_path, "dtrain/other/c.py", "from dtrain import rundir\nimport dtrain.other.d\n")
    _write(tmp_path, "dtrain/other/d.py", "")
    graph = package_graph(str(tmp_path), "dtrain")
    assert cycles(graph) == [["dtrain.high", "dtrain.low"]]
    [report] = cycle_report(graph)
    assert "dtrain.low.a:4 imports dtrain.high.b" in report and "dtrain.high.b:1 imports dtrain.low.a" in report
    assert set(graph["dtrain.other"]) == {"dtrain.rundir"}
    assert dict(graph["dtrain.rundir"]) == {}
    _write(tmp_path, "dtrain/rundir.py", "from dtrain.other import c\n")  # no longer TYPE_CHECKING-only
    assert cycles(package_graph(str(tmp_path), "dtrain")) == [["dtrain.high", "dtrain.low"],
                                                             ["dtrain.other", "dtrain.rundir"]]


def test_the_direction_check_reports_launch_reaching_up(tmp_path):
    for package in ("dtrain", "dtrain/launch", "dtrain/launch/engine", "dtrain/ui", "dtrain/pipeline"):
        _write(tmp_path, f"{package}/__init__.py")
    _write(tmp_path, "dtrain/launch/engine/x.py", "def f():\n    from dtrain.ui import thing\n")
    _write(tmp_path, "dtrain/launch/y.py", "import dtrain.pipeline\n")
    report = direction_report(package_graph(str(tmp_path), "dtrain"))
    assert [r.split(" (")[0] for r in report] == ["dtrain.launch.y:1 imports dtrain.pipeline",
                                                  "dtrain.launch.engine.x:2 imports dtrain.ui"]
