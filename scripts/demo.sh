#!/usr/bin/env bash
# Set everything up (idempotent), then run the retraining pipeline end to end with Airflow:
# preprocess -> stage -> preflight -> train (DDP, 2 simulated nodes x 2 processes) -> evaluate -> publish,
# against moto's S3 server on loopback and a directory standing in for the shared filesystem.
# Extra arguments go to the demo (e.g. --date 2026-01-02 --distribution deepspeed).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/bootstrap.sh"
source "$ROOT/scripts/airflow-env.sh"
cd "$ROOT"
airflow db migrate >/dev/null
exec python -m dtrain.pipeline.demo "$@"
