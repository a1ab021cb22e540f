#!/usr/bin/env bash
# Set everything up (idempotent), then run the test suite against real components.
# Services (moto's S3, sshd, Slurm, munge, Airflow) are started and stopped by the tests' fixtures.
#
#   bash scripts/test.sh                 # the whole suite, serially (what CI runs)
#   bash scripts/test.sh --quick         # the quick tier: no daemon, no Airflow, no training job (-m "not slow")
#   bash scripts/test.sh tests/launch -x # further arguments go to pytest
#   DTRAIN_TEST_WORKERS=2 bash scripts/test.sh ...   # on 2 pytest-xdist workers (--dist loadgroup, tests/conftest.py):
#                                        # not yet the default: on 2 cores some timing-bound tests fail under it
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
args=()
if [ "${1:-}" = "--quick" ]; then
  shift
  args+=(-m "not slow")
fi
workers=${DTRAIN_TEST_WORKERS:-0}
case "$workers" in
  ''|*[!0-9]*) echo "test.sh: DTRAIN_TEST_WORKERS='$workers' is invalid: a number of pytest-xdist workers (0: none)" >&2; exit 2 ;;
esac
# Tests that share a daemon run on one worker, each module on one worker (tests/conftest.py).
[ "$workers" = 0 ] || args+=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"
exec "$ROOT/.venv/bin/python" -m pytest "${args[@]}" "$@"
