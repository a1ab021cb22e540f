"""A REGULAR (non-editable) install of the repository into a fresh venv, once per session.

The dev venv's editable install puts the source root on sys.path, which hides packaging
mistakes: a module left out of the wheel, an entry point missing from the metadata, or a
package name that collides with a user's own (``operators``). Here:

* ``python -m venv --without-pip`` from the dev venv's base interpreter;
* the dev venv's third-party libraries made visible WITHOUT its airflow-dtrain: a folder of
  symlinks to every entry of the dev site-packages except airflow-dtrain's metadata, the
  editable finder and the ``.pth`` files, named by one ``.pth`` line in the fresh
  site-packages (a directory named in a ``.pth`` is appended to sys.path, the ``.pth`` files
  in it are not processed). Not the dev site-packages itself: its editable
  ``airflow_dtrain-*.dist-info`` would stay visible, and Airflow scans the entry points of
  every distribution on sys.path without de-duplication, so the dev metadata's
  ``airflow.plugins`` / provider entry points would stand in for missing ones in the wheel;
* ``pip install --no-deps --no-build-isolation --no-index`` of a copy of the repository
  (build artifacts such as ``operators/*.egg-info`` land in the copy, never in the repo);
* an ``airflow`` script in the fresh bin (Airflow itself comes from the dev venv).

Subprocesses get ``venv_env()``: the fresh bin first on PATH (ranks run ``sys.executable``,
torchrun agents ``python -m torch.distributed.run``), none of the suite's AIRFLOW_*/DTRAIN_*
settings, no PYTHONPATH, no dev venv bin.
"""

from __future__ import annotations

import configparser
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROJECTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "projects")
DIST_NAME = "airflow-dtrain"
DIST_PREFIX = "airflow_dtrain"
PTH_PROBE_DIR = "pth-in-devlibs-was-processed"

# Never copied from the repo: the dev venv, VCS data, build and run artifacts.
REPO_IGNORE = shutil.ignore_patterns(
    ".venv", ".git", "__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".dtrain", ".airflow*",
    ".pytest_cache", ".gpuwheels", ".gl", ".ci")


@dataclasses.dataclass(frozen=True)
class FreshInstall:
    root: str            # the session's temp folder
    venv: str
    bin: str
    python: str
    site_packages: str
    devlibs: str         # the symlink view of the dev venv's third-party libraries
    src: str             # the copy of the repository that pip installed from
    pip_log: str

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)


def base_python() -> str:
    """The interpreter the dev venv was made from."""
    base = getattr(sys, "_base_executable", None)
    if base and os.path.realpath(base) != os.path.realpath(sys.executable) and os.path.exists(base):
        return base
    cfg = os.path.join(sys.prefix, "pyvenv.cfg")
    if not os.path.exists(cfg):  # the tests run on a base interpreter
        return sys.executable
    home = _pyvenv_home(cfg)
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3", "python"):
        candidate = os.path.join(home, name)
        if os.path.exists(candidate):
            return candidate
    raise RuntimeError(f"no base interpreter found from {cfg}")


def _pyvenv_home(cfg: str) -> str:
    with open(cfg) as fh:
        for line in fh:
            key, _, value = line.partition("=")
            if key.strip() == "home":
                return value.strip()
    raise RuntimeError(f"{cfg} has no home")


def dev_site_dirs() -> list[str]:
    dirs = []
    for key in ("purelib", "platlib"):
        path = sysconfig.get_path(key)
        if path and os.path.isdir(path) and path not in dirs:
            dirs.append(path)
    return dirs


def _excluded_from_devlibs(name: str) -> bool:
    lowered = name.lower()
    return (lowered.startswith((DIST_PREFIX + "-", DIST_PREFIX + ".", "__editable__"))
            or lowered.endswith(".pth")
            or name in ("dtrain", "operators", "__pycache__"))


def make_devlibs(target: str) -> None:
    os.makedirs(target)
    for site_dir in dev_site_dirs():
        for name in sorted(os.listdir(site_dir)):
            link = os.path.join(target, name)
            if _excluded_from_devlibs(name) or os.path.lexists(link):
                continue
            os.symlink(os.path.join(site_dir, name), link)


def dev_bins() -> set[str]:
    """The dev venv's bin folder(s), dropped from PATH (its `dtrain`, `python` and `airflow`)."""
    bins = set()
    if sys.prefix != sys.base_prefix:
        bins |= {os.path.realpath(os.path.dirname(sys.executable)), os.path.realpath(os.path.join(sys.prefix, "bin"))}
    if os.environ.get("VIRTUAL_ENV"):
        bins.add(os.path.realpath(os.path.join(os.environ["VIRTUAL_ENV"], "bin")))
    return bins


def venv_env(fresh: FreshInstall, **extra: str) -> dict[str, str]:
    """A clean environment for processes of the fresh install (see the module docstring)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "DTRAIN_", "PYTHON", "PIP_", "VIRTUAL_ENV", "TORCHELASTIC", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")}
    bad = dev_bins()
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) not in bad]
    env["PATH"] = os.pathsep.join([fresh.bin, *path])
    env["VIRTUAL_ENV"] = fresh.venv
    env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    env["DTRAIN_HOME"] = fresh.path("dtrain_home")
    env.update(extra)
    return env


def run(argv, *, env, cwd, timeout: float, check: bool = False) -> subprocess.CompletedProcess:
    """Run ``argv`` in its own session; on timeout kill the whole session (nothing outlives a test)."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"timed out after {timeout}s: {argv}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
    result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}: {argv}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return result


def kill_session(sid: int) -> None:
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid:
                p.send_signal(signal.SIGKILL)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass


def processes_of(fresh: FreshInstall) -> list[psutil.Process]:
    """Live (non-zombie) processes that run the fresh venv's interpreter or mention its folder."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if any(fresh.root in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            pass
    return found


def wait_no_processes_of(fresh: FreshInstall, timeout: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = processes_of(fresh)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    described = []
    for p in left:
        try:
            described.append(f"{p.pid}: {' '.join(p.cmdline())}")
            p.kill()
        except psutil.Error:
            pass
    return described


def setup_cfg_entry_points(setup_cfg: str) -> dict[str, dict[str, str]]:
    """The entry points a setup.cfg declares: {group: {name: value}}."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(setup_cfg)
    groups = {}
    for group, block in parser["options.entry_points"].items():
        entries = {}
        for line in block.strip().splitlines():
            name, _, value = line.partition("=")
            entries[name.strip()] = value.strip().replace(" ", "")
        groups[group] = entries
    return groups


def copy_project(name: str, dest: str) -> str:
    shutil.copytree(os.path.join(PROJECTS, name), dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.fixture(scope="session")
def fresh_install(tmp_path_factory) -> FreshInstall:
    root = str(tmp_path_factory.mktemp("dtrain-regular-install"))
    venv = os.path.join(root, "venv")
    subprocess.run([base_python(), "-m", "venv", "--without-pip", venv], check=True, timeout=120,
                   capture_output=True, env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")})
    python = os.path.join(venv, "bin", "python")
    site_packages = subprocess.run(
        [python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, timeout=60, capture_output=True, text=True).stdout.strip()
    assert site_packages.startswith(venv), site_packages

    devlibs = os.path.join(root, "devlibs")
    make_devlibs(devlibs)
    # Probe for the claim above: a .pth inside an appended directory is not processed, so the
    # folder it names must never reach sys.path (checked in test_install).
    os.makedirs(os.path.join(root, PTH_PROBE_DIR))
    with open(os.path.join(devlibs, "_dtrain_test_probe.pth"), "w") as fh:
        fh.write(os.path.join(root, PTH_PROBE_DIR) + "\n")
    with open(os.path.join(site_packages, "_dtrain_test_devlibs.pth"), "w") as fh:
        fh.write(devlibs + "\n")

    src = os.path.join(root, "src")
    shutil.copytree(REPO, src, ignore=REPO_IGNORE)
    fresh = FreshInstall(root=root, venv=venv, bin=os.path.join(venv, "bin"), python=python,
                         site_packages=site_packages, devlibs=devlibs, src=src,
                         pip_log=os.path.join(root, "pip-install.log"))
    os.makedirs(fresh.path("dtrain_home"))
    proc = run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", src],
               env=venv_env(fresh), cwd=root, timeout=300)
    with open(fresh.pip_log, "w") as fh:
        fh.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    # Airflow comes from the dev venv; its console script must run the fresh interpreter.
    airflow = os.path.join(fresh.bin, "airflow")
    with open(airflow, "w") as fh:
        fh.write(f"#!{python}\nimport sys\nfrom airflow.__main__ import main\nsys.exit(main())\n")
    os.chmod(airflow, 0o755)
    return fresh


def installed_distributions(fresh: FreshInstall) -> list[dict]:
    """Every airflow-dtrain distribution the fresh interpreter sees, with where it lives and its entry points."""
    code = (
        "import json, importlib.metadata as m\n"
        "out = []\n"
        "for d in m.distributions():\n"
        f"    if (d.metadata['Name'] or '').lower().replace('_', '-') == {DIST_NAME!r}:\n"
        "        out.append({'path': str(d._path), 'direct_url': d.read_text('direct_url.json'),\n"
        "                    'top_level': d.read_text('top_level.txt'), 'files': [str(f) for f in d.files or []],\n"
        "                    'entry_points': sorted([e.group, e.name, e.value.replace(' ', '')] for e in d.entry_points)})\n"
        "print(json.dumps(out))\n")
    proc = run([fresh.python, "-c", code], env=venv_env(fresh), cwd=fresh.root, timeout=60, check=True)
    return json.loads(proc.stdout)
