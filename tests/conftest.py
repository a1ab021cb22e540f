"""Suite-wide setup: an isolated AIRFLOW_HOME and DTRAIN_HOME, set before anything imports Airflow."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_home = tempfile.mkdtemp(prefix="dtrain-tests-")
os.environ.setdefault("AIRFLOW_HOME", os.path.join(_home, "airflow"))
os.environ.setdefault("DTRAIN_HOME", os.path.join(_home, "dtrain"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", os.path.join(REPO, "dags"))
os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", os.path.join(REPO, "plugins"))
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "False")
# Two bundles: the product's dags/ and tests/dags/ (DAGs built for tests). dag.test() only runs
# DAGs that a bundle holds, so test DAGs live in files there and take their inputs as params.
os.environ.setdefault("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps([
    {"name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
     "kwargs": {"path": os.path.join(REPO, "dags")}},
    {"name": "test-dags", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
     "kwargs": {"path": os.path.join(REPO, "tests", "dags")}},
    {"name": "ui-test-dags", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
     "kwargs": {"path": os.path.join(REPO, "tests", "ui", "dags")}},
]))
os.environ.setdefault("PYTHONUNBUFFERED", "1")
# OpenMPI's session directories, per pytest process (each xdist worker's own): the namespace hosts share
# one /tmp and one hostname, so two mpiruns of parallel tests raced on /tmp/ompi.<host>.<uid> (one job's
# cleanup removed it as another's orted created its directory in it: "orte_session_dir failed"). mpirun
# passes the setting on to every orted (-mca orte_tmpdir_base). Real hosts have a /tmp each.
os.environ["OMPI_MCA_orte_tmpdir_base"] = _home
# The venv's bin must be on PATH: launched ranks, `airflow` subcommands and `dtrain` run from it.
_bin = os.path.dirname(sys.executable)
if _bin not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")

import subprocess  # noqa: E402

import pytest  # noqa: E402

# The suite's daemons, defined once (tests/services.py): one moto S3, one sshd cluster, one Slurm cluster.
from tests.services import (  # noqa: E402,F401
    CLUSTER_FIXTURES, OWN_CLUSTER_FIXTURES, faulty_cluster, faulty_slurm, moto_endpoint, net_cluster, s3_bucket, slurm,
    slurm_cluster, ssh_cluster,
)

#: session fixtures that start something expensive, in priority order: under pytest-xdist
#: (``--dist loadgroup``, scripts/test.sh) every test using one runs on the same worker, so each starts
#: once per suite; every other test goes with its module (module fixtures start once too).
SHARED_DAEMONS = (
    ("cluster", CLUSTER_FIXTURES),                                       # sshd hosts, Slurm: tests/services.py
    ("netcluster", frozenset({"net_cluster"})),                          # namespace hosts: tests/services.py
    ("airflow-deployment", frozenset({"deployment"})),                   # tests/pipeline/conftest.py
    ("fresh-install", frozenset({"fresh_install"})),                     # tests/packaging/conftest.py
)
#: the quick tier (``scripts/test.sh --quick``, ``-m "not slow"``) leaves out every test that starts a
#: daemon, Airflow or a training job: those folders and fixtures, and the tests that took longer than
#: QUICK_SECONDS in the run that wrote tests/durations.json (``pytest --store-durations``). A folder of
#: these names anywhere under tests/ is slow: every ``faults/`` (fault injection on the namespace cluster),
#: and everything under ``launch/backends/`` (the backend contracts, the sshd and Slurm hosts of ``remote/``)
SLOW_FOLDERS = frozenset({"faults", "packaging", "pipeline", "remote", "deepspeed", "backends", "mlflow"})
SLOW_FIXTURES = frozenset({"airflow_db", "api", "moto_endpoint", "s3_bucket", "s3", "s3_endpoint", "pipeline_env", "net_cluster",
                           *OWN_CLUSTER_FIXTURES,
                           "mlflow_server", "jobs"})
QUICK_SECONDS = 1.0
DURATIONS = os.path.join(REPO, "tests", "durations.json")


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help="write each test's time (setup + call + teardown) to tests/durations.json")


def _recorded_durations() -> dict[str, float]:
    try:
        with open(DURATIONS, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def is_slow(item, durations: dict[str, float]) -> bool:
    folders = item.nodeid.split("::", 1)[0].split("/")[1:-1]  # between tests/ and the file
    return (bool(SLOW_FOLDERS.intersection(folders)) or bool(set(item.fixturenames) & SLOW_FIXTURES)
            or durations.get(item.nodeid, 0.0) > QUICK_SECONDS)


def xdist_group(item) -> str:
    used = set(item.fixturenames)
    for group, fixtures in SHARED_DAEMONS:
        if used & fixtures:
            return group
    return item.nodeid.split("::", 1)[0]


#: where the workers leave {nodeid: group} for the controller's scheduler (set by the controller)
GROUPS_ENV = "DTRAIN_XDIST_GROUPS"


def pytest_configure(config):
    if not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") == "loadgroup":
        os.environ[GROUPS_ENV] = os.path.join(_home, "xdist-groups.json")  # workers start after this


def pytest_collection_modifyitems(config, items):
    """Group every test for xdist (:func:`xdist_group`; the scheduler below reads the groups) and put the
    cluster group first: it is the longest, and a group starts when a worker is free, so it must not
    start last. Within a group, collection order is kept (some modules' tests build on the ones before)."""
    rank = {group: i for i, (group, _) in enumerate(SHARED_DAEMONS)}
    # A module goes whole into the group of the highest-ranked daemon any of its tests uses: the tests
    # of a module keep their order (test_tabular_e2e's test_a must publish first) and one worker.
    by_module: dict[str, str] = {}
    for item in items:
        module, group = item.nodeid.split("::", 1)[0], xdist_group(item)
        current = by_module.get(module, module)
        if rank.get(group, len(rank)) < rank.get(current, len(rank)):
            current = group
        by_module[module] = current
    groups = {item.nodeid: by_module[item.nodeid.split("::", 1)[0]] for item in items}
    if os.environ.get(GROUPS_ENV):  # parallel run only: a serial run keeps pytest's order exactly
        items.sort(key=lambda item: rank.get(groups[item.nodeid], len(rank)))  # stable: file order within a rank
    durations = _recorded_durations()
    for item in items:
        if is_slow(item, durations):
            item.add_marker(pytest.mark.slow)
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker and os.environ.get(GROUPS_ENV):
        # Every worker collects the same tests (xdist checks), so each writes the same mapping.
        mine = f"{os.environ[GROUPS_ENV]}.{worker}"
        with open(mine, "w", encoding="utf-8") as fh:
            json.dump(groups, fh)
        os.replace(mine, os.environ[GROUPS_ENV])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups of :func:`xdist_group`. Not xdist's own LoadGroupScheduling:
    it reads ``xdist_group`` markers by renaming ``item._nodeid``, which pytest 9 no longer has (node
    ids live in ``item._id``), so every test was scheduled on its own and two Slurm clusters started.
    The controller cannot see fixtures; the workers' mapping (GROUPS_ENV) names each test's group."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class DaemonGroupScheduling(LoadScopeScheduling):
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                with open(os.environ[GROUPS_ENV], encoding="utf-8") as fh:
                    self._groups = json.load(fh)
            return self._groups.get(nodeid) or nodeid.split("::", 1)[0]

    return DaemonGroupScheduling(config, log)


_measured: dict[str, float] = {}
XDIST_GROUP_SUFFIX = re.compile(r"@[^\[\]@]*$")


def pytest_runtest_logreport(report):
    """Sum each test's phases for --store-durations (under xdist the controller gets every worker's reports)."""
    nodeid = XDIST_GROUP_SUFFIX.sub("", report.nodeid)  # under loadgroup xdist appends "@<group>"
    _measured[nodeid] = _measured.get(nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    if session.config.getoption("--store-durations") and not hasattr(session.config, "workerinput"):
        merged = {**_recorded_durations(), **{k: round(v, 3) for k, v in _measured.items()}}
        with open(DURATIONS, "w", encoding="utf-8") as fh:
            json.dump(dict(sorted(merged.items())), fh, indent=0)
            fh.write("\n")


def pytest_unconfigure(config):
    # This process's AIRFLOW_HOME and DTRAIN_HOME: each pytest process (controller, every xdist worker)
    # made its own, and its session fixtures (the daemons that used it) are finalized by now.
    import shutil

    shutil.rmtree(_home, ignore_errors=True)


@pytest.fixture(scope="session")
def airflow_db() -> str:
    """A migrated SQLite metadata DB in this session's AIRFLOW_HOME (for dag.test() and the CLI)."""
    home = os.environ["AIRFLOW_HOME"]
    marker = os.path.join(home, ".migrated")
    if not os.path.exists(marker):
        os.makedirs(home, exist_ok=True)
        subprocess.run([os.path.join(_bin, "airflow"), "db", "migrate"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
        open(marker, "w").close()
    return home


def load_test_dag(filename: str, dag_id: str, folder: str = os.path.join("tests", "dags")):
    """The DAG ``dag_id`` from <folder>/<filename>, ready for ``dag.test(run_conf=...)``."""
    import importlib.util

    path = os.path.join(REPO, folder, filename)
    spec = importlib.util.spec_from_file_location(f"test_dags_{filename[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for value in vars(module).values():
        if getattr(value, "dag_id", None) == dag_id and hasattr(value, "test"):
            return value
    raise LookupError(f"no DAG {dag_id!r} in {path}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, for the leftover check below."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def own_tmpdir(tmp_path, monkeypatch) -> str:
    """This test's own temp directory, as TMPDIR and tempfile's, for it and what it starts with its
    environment: libraries that make temp directories and never remove them (MLflow downloads a model
    to one at each load) leave them under tmp_path, not in /tmp. Session fixtures start before it."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return str(path)


@pytest.fixture(autouse=True)
def no_job_process_outlives_the_test(request):
    """A finalizer for every test: whatever a test started that carries a job id (ranks, agents,
    detached nodes, a rank's escaped children) is stopped when the test ends, pass or fail. A test
    that passed but left one fails: that is a leak of the product, not of the test. Only this
    session's jobs count (their run directories lie under its temp dirs): other runs on the
    machine are none of its business."""
    yield
    from dtrain.launch.node.proctree import kill_processes, processes_where

    ours = (str(request.config._tmp_path_factory.getbasetemp()), _home)
    left = processes_where(lambda environ: "DTRAIN_JOB_ID" in environ
                           and environ.get("DTRAIN_RUN_DIR", "").startswith(ours))
    if left:
        import psutil

        _, left = psutil.wait_procs(left, timeout=15)  # a job that just ended is still exiting
    if left:
        described = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left if p.is_running()]
        kill_processes(left, grace=5.0)
        call = getattr(request.node, "rep_call", None)
        if call is not None and call.passed and described:
            pytest.fail(f"processes of a job outlived the test (now stopped): {described}")
