"""The installed distribution: provider entry point seen by Airflow, `dtrain` console script, cheap imports."""

from __future__ import annotations

import os
import subprocess
import sys

BIN = os.path.dirname(sys.executable)


def test_airflow_provider_manager_sees_the_provider():
    from airflow.providers_manager import ProvidersManager

    info = ProvidersManager().providers["airflow-dtrain"]
    assert info.data["name"] == "Distributed training (dtrain)"
    assert "dtrain.launch.airflow.operator" in info.data["operators"][0]["python-modules"]


def test_dtrain_console_script_lists_launch():
    out = subprocess.run([os.path.join(BIN, "dtrain"), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "launch" in out.stdout


def test_operator_import_pulls_no_heavy_library():
    from tests.support import heavy_libraries_imported_by

    assert heavy_libraries_imported_by("dtrain.launch.airflow.operator", "dtrain.launch.engine.launcher") == []


def test_bad_cli_input_exits_nonzero_with_named_field():
    out = subprocess.run([os.path.join(BIN, "dtrain"), "launch", "--nodes", "0", "--", "true"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "nodes=0 is invalid: must be at least 1" in out.stderr
