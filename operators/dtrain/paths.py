"""Where run directories live: the product's home, the runs roots, and how a run directory is named.

Every run directory the product makes lies under a runs root, ``<base>/runs``:

- a job launched without a ``run_dir`` (``dtrain launch``): ``$DTRAIN_HOME/runs/<job id>``;
- the training operator's default: ``$DTRAIN_HOME/runs/<dag_id>/<run_id>/<task_id>``;
- the pipeline factory's: ``<shared_fs>/runs/<dag_id>/<version>/<partition>/run-<n>``.

The UI shows a run directory only under a runs root, as ``<root>/<dag_id>/...``
(:mod:`dtrain.ui.provenance`), so these names and its defaults come from here.

Stdlib only: the launcher, the operators, the pipeline factory and the UI all import it.
"""

from __future__ import annotations

import os
import re

#: the folder under a base directory that holds its run directories
RUNS = "runs"
#: characters a path component taken from a DAG, run or task id may keep
_UNSAFE = re.compile(r"[^A-Za-z0-9_.=-]+")


def dtrain_home() -> str:
    """The product's own folder on this host (``$DTRAIN_HOME``, default ``~/.dtrain``)."""
    return os.environ.get("DTRAIN_HOME") or os.path.join(os.path.expanduser("~"), ".dtrain")


def runs_root(base: str) -> str:
    """The runs root under ``base`` (``$DTRAIN_HOME`` or a pipeline's shared filesystem)."""
    return os.path.join(base, RUNS)


def safe_part(part: str) -> str:
    """``part`` (a DAG, run or task id) as one path component: each run of other characters becomes ``_``,
    and so does a part of dots alone, or none (Airflow allows ``..`` as a run id, which anyone who may trigger the
    DAG chooses: as a component it would name the folder above)."""
    safe = _UNSAFE.sub("_", part)
    return "_" * max(1, len(safe)) if safe.strip(".") == "" else safe


def job_run_dir(job_id: str) -> str:
    """A job's run directory when its spec names none."""
    return os.path.join(runs_root(dtrain_home()), job_id)


def task_run_dir(dag_id: str, run_id: str, task_id: str) -> str:
    """The training operator's default run directory for one task of one DAG run."""
    return os.path.join(runs_root(dtrain_home()), safe_part(dag_id), safe_part(run_id), safe_part(task_id))


def pipeline_run_dir(shared_fs: str, dag_id: str, version: str, partition: str, attempt: str) -> str:
    """A pipeline's run directory for one version and partition; ``attempt`` numbers its clears (the
    factory passes Jinja expressions for the last three)."""
    return os.path.join(runs_root(shared_fs), dag_id, version, partition, f"run-{attempt}")
