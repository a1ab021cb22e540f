"""What a regular ``pip install`` of the repository puts in a fresh venv, and that it stands alone."""

from __future__ import annotations

import ast
import filecmp
import json
import os
import re

from .conftest import DIST_PREFIX, PTH_PROBE_DIR, REPO, installed_distributions, run, setup_cfg_entry_points, venv_env


def test_install_is_regular_and_not_the_dev_tree(fresh_install):
    code = ("import json, sys, dtrain, dtrain.launch.node.rank_entry as r; "
            "print(json.dumps({'dtrain': dtrain.__file__, 'rank_entry': r.__file__, 'path': sys.path}))")
    proc = run([fresh_install.python, "-c", code], env=venv_env(fresh_install), cwd=fresh_install.root,
               timeout=60, check=True)
    seen = json.loads(proc.stdout)
    package_dir = os.path.join(fresh_install.site_packages, "dtrain")
    assert seen["dtrain"] == os.path.join(package_dir, "__init__.py")
    assert seen["rank_entry"] == os.path.join(package_dir, "launch", "node", "rank_entry.py")
    # The .pth line adds the dev libraries; the dev venv's editable finder (a .pth naming
    # <repo>/operators) is not processed, so the source tree is nowhere on sys.path.
    assert fresh_install.devlibs in seen["path"]
    assert fresh_install.path(PTH_PROBE_DIR) not in seen["path"]
    assert not [p for p in seen["path"] if p and os.path.realpath(p).startswith(os.path.realpath(REPO) + os.sep)]

    assert not [n for n in os.listdir(fresh_install.site_packages)
                if n.startswith("__editable__") or n.endswith(".egg-link")], "an editable install"
    dists = installed_distributions(fresh_install)
    assert len(dists) == 1, f"more than one airflow-dtrain visible: {[d['path'] for d in dists]}"
    dist = dists[0]
    assert os.path.dirname(dist["path"]) == fresh_install.site_packages
    assert json.loads(dist["direct_url"]).get("dir_info", {}).get("editable") is not True
    assert dist["top_level"].split() == ["dtrain"]
    # Nothing named like a user's package is installed: only dtrain and its metadata.
    ours = sorted(n for n in os.listdir(fresh_install.site_packages)
                  if n not in ("_dtrain_test_devlibs.pth", "__pycache__"))
    assert len(ours) == 2 and ours[1] == "dtrain", ours
    assert ours[0].startswith(DIST_PREFIX + "-") and ours[0].endswith(".dist-info"), ours


def test_wheel_holds_every_source_file(fresh_install):
    """Every file of the source package (modules and any package data) is installed, byte for byte."""
    source_root = os.path.join(fresh_install.src, "operators", "dtrain")
    installed_root = os.path.join(fresh_install.site_packages, "dtrain")
    missing, differ, source_files = [], [], set()
    for dirpath, dirnames, filenames in os.walk(source_root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith((".pyc", ".pyo")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), source_root)
            source_files.add(rel)
            target = os.path.join(installed_root, rel)
            if not os.path.exists(target):
                missing.append(rel)
            elif not filecmp.cmp(os.path.join(source_root, rel), target, shallow=False):
                differ.append(rel)
    # `packages = find:` only finds folders with an __init__.py: one without is left out of the
    # wheel, while the editable install (the source root on sys.path) still imports it.
    no_init = sorted({os.path.dirname(rel) for rel in source_files if rel.endswith(".py")}
                     - {os.path.dirname(rel) for rel in source_files if os.path.basename(rel) == "__init__.py"})
    assert not missing, (f"source files not in the installed package (not in the wheel): {missing}; "
                         f"package folders without __init__.py: {no_init}")
    assert not differ, differ
    assert "launch/node/rank_entry.py" in source_files and len(source_files) > 50
    # and nothing the source does not have (e.g. a stale build/ folder in the copy)
    extra = []
    for dirpath, dirnames, filenames in os.walk(installed_root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        extra += [r for r in (os.path.relpath(os.path.join(dirpath, n), installed_root) for n in filenames)
                  if r not in source_files]
    assert not extra, extra


def test_entry_points_are_the_ones_setup_cfg_declares(fresh_install):
    declared = setup_cfg_entry_points(os.path.join(fresh_install.src, "setup.cfg"))
    (dist,) = installed_distributions(fresh_install)
    installed = {}
    for group, name, value in dist["entry_points"]:
        installed.setdefault(group, {})[name] = value
    assert installed == declared
    assert installed["console_scripts"]["dtrain"] == "dtrain.cli:main"
    assert installed["apache_airflow_provider"]["provider_info"].startswith("dtrain.")
    # every entry point resolves in the installed package
    code = ("import importlib.metadata as m\n"
            "d = m.distribution('airflow-dtrain')\n"
            "for ep in d.entry_points: ep.load(); print(ep.group, ep.name, 'ok')\n")
    proc = run([fresh_install.python, "-c", code], env=venv_env(fresh_install), cwd=fresh_install.root,
               timeout=120, check=True)
    assert proc.stdout.count(" ok") == sum(len(v) for v in declared.values()), proc.stdout


def test_console_script_is_in_the_fresh_bin_and_runs_its_python(fresh_install):
    script = os.path.join(fresh_install.bin, "dtrain")
    assert os.access(script, os.X_OK)
    with open(script) as fh:
        assert fh.readline().strip() == f"#!{fresh_install.python}"
    proc = run(["dtrain", "--help"], env=venv_env(fresh_install), cwd=fresh_install.root, timeout=60, check=True)
    assert "launch" in proc.stdout
    proc = run(["dtrain", "launch", "--nodes", "0", "--", "true"], env=venv_env(fresh_install),
               cwd=fresh_install.root, timeout=60)
    assert proc.returncode == 2 and "nodes=0 is invalid" in proc.stderr, proc.stderr


OLD_NAME = re.compile(r"^operators\.\w")


def test_no_installed_module_refers_to_the_old_package_name(fresh_install):
    """No import of ``operators.*`` and no ``"operators.x"`` module string (``-m operators.launch...``)."""
    installed_root = os.path.join(fresh_install.site_packages, "dtrain")
    offenders = []
    for dirpath, dirnames, filenames in os.walk(installed_root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), path)
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names = [node.value]
                for n in names:
                    if n == "operators" and not isinstance(node, ast.Constant) or OLD_NAME.match(n):
                        offenders.append(f"{os.path.relpath(path, installed_root)}:{node.lineno}: {n!r}")
    assert not offenders, offenders


def test_every_installed_module_imports(fresh_install):
    """All of dtrain imports from the installed copy, run from a folder holding a user's ``operators``."""
    cwd = os.path.join(fresh_install.root, "import_all")
    os.makedirs(os.path.join(cwd, "operators"), exist_ok=True)
    open(os.path.join(cwd, "operators", "__init__.py"), "w").close()
    code = ("import importlib, json, pkgutil, sys, dtrain\n"
            "errors, names = {}, []\n"
            "def failed(name): errors[name] = repr(sys.exc_info()[1])\n"
            "for mod in pkgutil.walk_packages(dtrain.__path__, 'dtrain.', onerror=failed):\n"
            "    names.append(mod.name)\n"
            "    try:\n"
            "        m = importlib.import_module(mod.name)\n"
            "        assert m.__file__.startswith(%r), m.__file__\n"
            "    except BaseException as e:\n"
            "        errors[mod.name] = repr(e)\n"
            "print(json.dumps({'names': names, 'errors': errors}))\n") % (fresh_install.site_packages,)
    proc = run([fresh_install.python, "-c", code], env=venv_env(fresh_install), cwd=cwd, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["errors"], result["errors"]
    assert "dtrain.launch.node.rank_entry" in result["names"] and len(result["names"]) > 50
