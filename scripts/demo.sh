#!/usr/bin/env bash
# Set everything up (idempotent), then run the demo pipeline end to end with Airflow.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/bootstrap.sh"
source "$ROOT/scripts/airflow-env.sh"
cd "$ROOT"
airflow db migrate >/dev/null
log=$(mktemp)
if ! airflow dags test ddp_demo >"$log" 2>&1; then
  tail -n 60 "$log"; echo "demo: the DAG run failed (full log: $log)" >&2; exit 1
fi
grep -E "\[node[0-9]+ rank0\]" "$log" | sed 's/ *\[airflow\.task.*//; s/^.*\] \[node/[node/' | tail -n 3
grep "DEMO RESULT" "$log"
rm -f "$log"
