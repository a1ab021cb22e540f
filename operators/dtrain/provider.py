"""Provider metadata for Airflow's provider manager (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from operators import __version__


def get_provider_info() -> dict:
    return {
        "package-name": "airflow-dtrain",
        "name": "Distributed training (dtrain)",
        "description": "Preprocess, stage to a shared filesystem and launch multi-node DDP/DeepSpeed training.",
        "versions": [__version__],
        "operators": [
            {
                "integration-name": "Distributed training",
                "python-modules": ["operators.launch.operator", "operators.staging.operator",
                                   "operators.preprocess.operator", "operators.preflight.operator"],
            }
        ],
    }
