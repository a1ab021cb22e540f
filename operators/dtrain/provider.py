"""Provider metadata for Airflow's provider manager (entry point ``apache_airflow_provider``).

The dict follows Airflow's runtime ``provider_info.schema.json`` (tests/test_provider.py
validates it); ``airflow providers triggers`` and ``airflow providers links`` list what it
declares. Every ``integration-name`` used below is declared under ``integrations``.

The plugin (macros, operator extra links) is *not* declared here under ``plugins``: it has
its own ``airflow.plugins`` entry point (dtrain.plugin), and declaring it twice would make
Airflow skip the second copy as "already registered".

Importing this module must stay cheap: plain data, no Airflow or torch imports.
"""

from __future__ import annotations

from dtrain import __version__

INTEGRATION = "Distributed training"


def get_provider_info() -> dict:
    return {
        "package-name": "airflow-dtrain",
        "name": "Distributed training (dtrain)",
        "description": "Preprocess, stage to a shared filesystem and launch multi-node DDP/DeepSpeed training.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": INTEGRATION,
                "external-doc-url": "https://docs.pytorch.org/docs/stable/distributed.html",
                "tags": ["machine-learning", "software"],
            }
        ],
        "operators": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["dtrain.launch.airflow.operator", "dtrain.staging.operator",
                                   "dtrain.preprocess.operator", "dtrain.preflight.operator",
                                   "dtrain.autotune.operator"],
            }
        ],
        # Modules holding triggers (the schema's "python-modules"): DistributedJobTrigger.
        "triggers": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["dtrain.launch.airflow.trigger"],
            }
        ],
        "extra-links": [
            "dtrain.launch.airflow.links.CheckpointLink",
            "dtrain.launch.airflow.links.TrainingLink",
            "dtrain.launch.airflow.links.TensorBoardLink",
        ],
    }
