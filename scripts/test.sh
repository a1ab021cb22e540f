#!/usr/bin/env bash
# Set everything up (idempotent), then run the whole test suite against real components.
# Services (moto's S3, sshd, Slurm, munge) are started and stopped by the tests' fixtures.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
