"""The launch package's layers, checked statically (dtrain/launch/__init__.py says why each holds).

The folder of a module under ``dtrain/launch`` names the process it runs in, and so what it may
import: ``node/`` runs beside the ranks, possibly on a host without Airflow; ``engine/`` is the
launcher, which the ``dtrain`` CLI runs without Airflow; ``airflow/`` runs in a worker or the
triggerer. ``core/`` (the job model, node supervision) is below the launcher and the backends'
own folders; the backend contract, registry and placement (``backends/__init__.py``, ``base.py``,
``placement.py``) are below the job model, which checks itself against a backend's class and whose
placement the registry resolves. Nothing in launch imports the packages built on top of it (the training helper, the UI,
the pipeline). Parsed, not imported: an import inside a function, or under ``if TYPE_CHECKING:``,
counts like one at the top of the module.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys

from tests.import_scan import runtime_nodes

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "operators", "dtrain")

#: (folder under dtrain/launch, "" for all of it; imports it must not make; why)
FORBIDDEN = (
    ("node", ("dtrain.launch.engine", "dtrain.launch.core", "dtrain.launch.airflow", "airflow"),
     "node/ runs beside the ranks, possibly on a host without Airflow"),
    ("engine", ("airflow", "dtrain.launch.airflow"),
     "engine/ is the launcher, which also runs without Airflow: dtrain launch"),
    ("core", ("airflow", "dtrain.launch.airflow", "dtrain.launch.engine"),
     "core/ is below the launcher: the launcher and the backends build on the job model"),
    ("backends", ("dtrain.launch.engine", "dtrain.launch.airflow"),
     "backends/ run jobs for the launcher: they build on core/ and node/, never on the launcher"),
    ("backends/", ("dtrain.launch.core",),
     "the backend contract, registry and placement are below the job model (a spec checks itself against them)"),
    ("", ("dtrain.links", "dtrain.training", "dtrain.ui", "dtrain.pipeline", "dtrain.plugin"),
     "launch is below the training helper, the UI, the pipeline and the plugin"),
)
#: rules checked on the imports that run (the contract's method signatures name the job model's types,
#: under ``if TYPE_CHECKING:``: an annotation is no dependency at import or run time)
RUNTIME_ONLY = {"backends/"}
#: the only dtrain modules a node-side module may import (besides the bare package): stdlib-only ones
#: (the grammar checks a node's own arguments, as the launcher's)
NODE_MAY_IMPORT = ("dtrain.launch.node", "dtrain.rundir", "dtrain.errors", "dtrain.grammar")
#: the folders of dtrain/launch, and the modules directly in it: the stable public re-exports
FOLDERS = {"airflow", "core", "engine", "node", "backends"}
PUBLIC_REEXPORTS = {
    "operator.py": ("dtrain.launch.airflow.operator", ["DistributedTrainingOperator"]),
    "trigger.py": ("dtrain.launch.airflow.trigger", ["DistributedJobTrigger"]),
}


def launch_modules():
    """(path relative to dtrain/launch, dotted module name, parsed tree) of every module in launch."""
    root = os.path.join(PACKAGE, "launch")
    for directory, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                module = "dtrain.launch." + rel[:-3].replace("/", ".")
                module = module.removesuffix(".__init__")
                with open(path, encoding="utf-8") as fh:
                    yield rel, module, ast.parse(fh.read(), path)


def imported(tree: ast.AST, module: str, is_package: bool, runtime_only: bool = False) -> list[tuple[int, str]]:
    """(line, name) for every import anywhere in ``tree`` (``runtime_only``: not under ``if TYPE_CHECKING:``);
    ``from X import y`` gives X and X.y (y may be a submodule); relative imports are resolved against ``module``."""
    found = []
    for node in (runtime_nodes(tree) if runtime_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def _directly_in(rel: str, folder: str) -> bool:
    """``folder`` ending in "/" names the modules directly in it (``backends/``: the contract and the
    registry, not a backend's own folder)."""
    return folder.endswith("/") and rel.startswith(folder) and "/" not in rel[len(folder):]


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations() -> list[str]:
    """One line per offending import statement and rule."""
    found: dict[tuple[str, int, str], str] = {}
    for rel, module, tree in launch_modules():
        folder = rel.split("/")[0] if "/" in rel else ""
        names = imported(tree, module, rel.endswith("__init__.py"))
        running = imported(tree, module, rel.endswith("__init__.py"), runtime_only=True)
        for applies_to, forbidden, why in FORBIDDEN:
            if applies_to and folder != applies_to and not _directly_in(rel, applies_to):
                continue
            for line, name in (running if applies_to in RUNTIME_ONLY else names):
                hit = next((prefix for prefix in forbidden if within(name, prefix)), None)
                if hit:
                    found.setdefault((rel, line, why), name)
        if folder == "node":
            for line, name in names:
                if within(name, "dtrain") and name != "dtrain" and not any(within(name, p) for p in NODE_MAY_IMPORT):
                    if not any(within(name, p) for _, forbidden, _ in FORBIDDEN for p in forbidden):
                        found.setdefault((rel, line, f"node/ may import only {', '.join(NODE_MAY_IMPORT)} from dtrain"),
                                         name)
    return [f"launch/{rel}:{line} imports {name} ({why})" for (rel, line, why), name in sorted(found.items())]


def test_each_layer_imports_only_what_its_process_may():
    assert violations() == []


def test_the_check_catches_what_it_forbids(tmp_path, monkeypatch):
    """Not vacuous: each rule reports a planted import, at the top of a module or inside a function."""
    launch = tmp_path / "dtrain" / "launch"
    for folder in ("node", "engine", "airflow", "core", "backends/ssh"):
        (launch / folder).mkdir(parents=True)
    (launch / "node" / "a.py").write_text("from dtrain.launch.engine import hang\n"
                                          "def f():\n    import airflow.sdk\n"
                                          "def g():\n    from ..airflow import operator\n"
                                          "from dtrain import args\n")
    (launch / "engine" / "b.py").write_text("def f():\n    from airflow.triggers.base import BaseTrigger\n"
                                            "def g():\n    from dtrain.launch.airflow.resumable import x\n")
    (launch / "airflow" / "c.py").write_text("from dtrain.links import LINKS\n"
                                             "def f():\n    from dtrain.training.stall_report import summarize\n"
                                             "from dtrain import ui\n")
    (launch / "d.py").write_text("import dtrain.pipeline.factory\n")
    (launch / "node" / "e.py").write_text("from dtrain.launch.core import spec\n")
    (launch / "core" / "f.py").write_text("from dtrain.launch.backends import backend_for\n"  # allowed: the registry
                                          "def f():\n    from dtrain.launch.engine.launcher import Launcher\n")
    (launch / "backends" / "base.py").write_text("from dtrain.launch.node.net import free_port\n"  # allowed
                                                 "from dtrain.launch.core.processes import NodeSupervisor\n"
                                                 "if TYPE_CHECKING:\n    from dtrain.launch.core.spec import X\n")
    (launch / "backends" / "ssh" / "g.py").write_text("from dtrain.launch.core.job import Job\n"  # allowed
                                                      "from dtrain.launch.backends.base import Backend\n"  # allowed
                                                      "from ...engine import launcher\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(tmp_path / "dtrain"))
    assert sorted({v.split(" ")[0] for v in violations()}) == [
        "launch/airflow/c.py:1", "launch/airflow/c.py:3", "launch/airflow/c.py:4",
        "launch/backends/base.py:2", "launch/backends/ssh/g.py:3", "launch/core/f.py:3", "launch/d.py:1",
        "launch/engine/b.py:2", "launch/engine/b.py:4",
        "launch/node/a.py:1", "launch/node/a.py:3", "launch/node/a.py:5", "launch/node/a.py:6", "launch/node/e.py:1",
    ]


def test_every_launch_module_is_in_a_layer_folder():
    """A module straight in dtrain/launch would escape the folder rules: only the public re-exports are there."""
    top = {rel for rel, _, _ in launch_modules() if "/" not in rel}
    assert top == {"__init__.py", *PUBLIC_REEXPORTS}
    folders = {rel.split("/")[0] for rel, _, _ in launch_modules() if "/" in rel}
    assert folders == FOLDERS
    for folder in FOLDERS:
        assert os.path.isfile(os.path.join(PACKAGE, "launch", folder, "__init__.py")), folder


def test_public_reexports_hold_nothing_but_the_reexport():
    for name, (target, names) in PUBLIC_REEXPORTS.items():
        with open(os.path.join(PACKAGE, "launch", name), encoding="utf-8") as fh:
            body = ast.parse(fh.read()).body
        assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), f"{name}: no docstring"
        imports = [node for node in body if isinstance(node, ast.ImportFrom)]
        assert [(i.module, [a.name for a in i.names]) for i in imports] == [(target, names)], name
        rest = [node for node in body[1:] if not isinstance(node, ast.ImportFrom)]
        assert all(isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"] for node in rest), name


def test_public_paths_are_the_moved_objects():
    """What users' DAG files import, and the trigger classpath Airflow stored for tasks deferred before
    the move (the triggerer imports it to run them again), are the classes themselves."""
    for name, (target, names) in PUBLIC_REEXPORTS.items():
        public = importlib.import_module("dtrain.launch." + name[:-3])
        for attr in names:
            assert getattr(public, attr) is getattr(importlib.import_module(target), attr)
    from dtrain.launch.airflow.trigger import DistributedJobTrigger
    from dtrain.launch.backends import JobHandle

    handle = JobHandle("ssh", "job", "job", "/runs/r", 2, 0.0, data={"hosts": ["a"], "ssh": {}, "detached": True})
    classpath, _ = DistributedJobTrigger(handle=handle.to_dict(), poll_interval=1).serialize()
    for stored in (classpath, "dtrain.launch.trigger.DistributedJobTrigger"):
        module, _, cls = stored.rpartition(".")
        assert getattr(importlib.import_module(module), cls) is DistributedJobTrigger, stored
