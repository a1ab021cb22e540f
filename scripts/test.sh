#!/usr/bin/env bash
# Set everything up (idempotent), then run the test suite against real components.
# Services (moto's S3, sshd, Slurm, munge, Airflow) are started and stopped by the tests' fixtures.
#
#   bash scripts/test.sh                 # the whole suite on 2 pytest-xdist workers (what CI runs)
#   bash scripts/test.sh --quick         # the quick tier, on 2 workers too: no daemon, no Airflow, no training job (-m "not slow")
#   bash scripts/test.sh --compat        # the quick tier against the oldest torch setup.cfg allows and the newest
#                                        # on the registry, each in its own venv (.dtrain/venv-torch-X.Y.Z)
#   bash scripts/test.sh tests/launch -x # further arguments go to pytest
#   DTRAIN_TEST_WORKERS=0 bash scripts/test.sh ...   # serially; N: on N workers (--dist loadgroup, tests/conftest.py)
#
# Two workers, not one per core: the suite's jobs are multi-process themselves (2-4 ranks, sshd and
# Slurm hosts), and on 2 cores a third worker only makes their timeouts tighter.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
args=()
default_workers=2
[ "$(nproc)" -ge 2 ] || default_workers=0
if [ "${1:-}" = "--compat" ]; then
  shift
  exec bash "$ROOT/scripts/compat.sh" "$@"
fi
if [ "${1:-}" = "--quick" ]; then
  shift
  args+=(-m "not slow")  # on the same workers: its tests run in a third less time than serially
fi
workers=${DTRAIN_TEST_WORKERS:-$default_workers}
case "$workers" in
  ''|*[!0-9]*) echo "test.sh: DTRAIN_TEST_WORKERS='$workers' is invalid: a number of pytest-xdist workers (0: none)" >&2; exit 2 ;;
esac
# Tests that share a daemon run on one worker, each module on one worker (tests/conftest.py).
[ "$workers" = 0 ] || args+=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"
exec "$ROOT/.venv/bin/python" -m pytest "${args[@]}" "$@"
