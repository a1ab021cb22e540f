"""A training command whose first try fails: ``flaky.py <run_dir> <true|false> -- <command...>``.

With ``true``, the first try (no marker in the run directory yet) leaves a marker and exits 1, as a
crash would; the Airflow retry reuses the run directory, finds the marker and runs the command.
Each try also writes the MLflow variables it was given to ``mlflow-env-<RANK>.json`` (what a
script that logs to MLflow itself would use)."""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    run_dir, fail_first, _, *command = argv
    given = {name: os.environ.get(name) for name in ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")}
    with open(os.path.join(run_dir, f"mlflow-env-{os.environ.get('RANK', '0')}.json"), "w") as fh:
        json.dump(given, fh)
    marker = os.path.join(run_dir, "flaky-first-try")
    if fail_first.lower() == "true" and not os.path.exists(marker):
        open(marker, "w").close()
        print("flaky: failing the first try on purpose", flush=True)
        return 1
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
