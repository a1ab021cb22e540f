"""The Airflow plugin: template macros and the training operator's extra links.

Macros, in any templated field: ``{{ macros.dtrain.scaled_lr(0.1, 256, 32) }}`` and
``{{ macros.dtrain.global_batch_size(32, params.nodes, params.procs_per_node) }}``.
Provider metadata comes from the package's ``apache_airflow_provider`` entry point.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from operators.links import LINKS, MACROS


class DTrainPlugin(AirflowPlugin):
    name = "dtrain"
    macros = MACROS
    operator_extra_links = LINKS
