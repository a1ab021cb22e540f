"""The Airflow plugin: template macros, the training operator's extra links, and the UI pages.

Pages (dtrain.ui): a "Training" tab on every task instance (``external_views`` with destination
``task_instance``) and a "Retraining" page in the navigation, both served with their JSON API
by the plugin's FastAPI app under ``/dtrain`` (built on its first request).

Macros (:data:`MACROS`), in any templated field: ``{{ macros.dtrain.scaled_lr(0.1, 256, 32) }}``
and ``{{ macros.dtrain.global_batch_size(32, params.nodes, params.procs_per_node) }}``. The operator
extra links are the training operator's own (dtrain.launch.airflow.links), registered here too.

Registered by installation: the package's ``airflow.plugins`` entry point
(``dtrain = dtrain.plugin:DTrainPlugin``) makes ``pip install airflow-dtrain`` enough.
For folder-based deployments ``plugins/dtrain_plugin.py`` re-exports the class, but only
when that entry point is not installed (see :func:`registered_by_entry_point`): Airflow
loads the plugins folder before entry points and skips a second plugin of the same name
with an "already registered" import error.

Provider metadata (triggers, extra links) comes from the ``apache_airflow_provider``
entry point (dtrain.provider).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from dtrain.launch.airflow.links import LINKS
from dtrain.training.scaling import scaled_lr
from dtrain.ui import URL_PREFIX, LazyApp, external_views, ui_base

ENTRY_POINT_GROUP = "airflow.plugins"
ENTRY_POINT_VALUE = "dtrain.plugin:DTrainPlugin"


def global_batch_size(per_rank_batch: int, nodes: int, procs_per_node: int, grad_accum: int = 1) -> int:
    """Samples per optimizer step across the job: per-rank batch x ranks x accumulation steps."""
    return int(per_rank_batch) * int(nodes) * int(procs_per_node) * int(grad_accum)


MACROS = [scaled_lr, global_batch_size]


class DTrainPlugin(AirflowPlugin):
    name = "dtrain"
    macros = MACROS
    operator_extra_links = LINKS
    fastapi_apps = [{"app": LazyApp(), "url_prefix": URL_PREFIX, "name": "dtrain"}]
    external_views = external_views(ui_base())


def registered_by_entry_point() -> bool:
    """Whether an installed distribution registers DTrainPlugin under ``airflow.plugins``.

    Scans every distribution on sys.path, not ``entry_points()``'s one-per-name view,
    because Airflow's loader does the same: a stale copy of this package's metadata found
    first must not hide the entry point that Airflow will load.
    """
    from importlib.metadata import distributions

    for dist in distributions():
        try:
            if any(ep.group == ENTRY_POINT_GROUP and ep.value.replace(" ", "") == ENTRY_POINT_VALUE
                   for ep in dist.entry_points):
                return True
        except Exception:  # another distribution's broken metadata (Airflow skips it too)
            continue
    return False
