"""The dtrain Airflow plugin, for folder-based deployments (this file in $AIRFLOW_HOME/plugins).

The plugin lives in the package (dtrain.plugin). An installed package registers it through
its ``airflow.plugins`` entry point, so ``pip install`` alone is enough; this file then
exposes nothing, because Airflow loads the plugins folder first and would skip the entry
point's copy as "Plugin 'dtrain' already registered". Without that entry point (dtrain only
importable, e.g. on PYTHONPATH), this file registers the plugin.
"""

from __future__ import annotations

from dtrain.plugin import registered_by_entry_point

if not registered_by_entry_point():
    from dtrain.plugin import DTrainPlugin  # noqa: F401
