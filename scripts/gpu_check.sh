#!/usr/bin/env bash
# The GPU path, for a host with NVIDIA GPUs and PyTorch (no Airflow needed): the launcher's
# GPU-count check, DDP over NCCL, and DeepSpeed ZeRO-1/2 on CUDA with the reference script.
# Usage: bash scripts/gpu_check.sh [PYTHON]   (run from the repository root)
set -uo pipefail
PY=${1:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} DTRAIN_HOME=${DTRAIN_HOME:-$(mktemp -d)} PYTHONUNBUFFERED=1
dtrain() { "$PY" -m dtrain.cli "$@"; }
step() { echo; echo "=== $*"; }

step "host"
nvidia-smi -L
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")

step "spec refuses more processes per node than GPUs ($((ngpu + 1)) > $ngpu)"
dtrain launch --procs-per-node $((ngpu + 1)) -- "$PY" -c pass; echo "exit=$? (expected 2)"

step "DDP over NCCL: 1 node x $ngpu GPU(s)"
dtrain launch --procs-per-node "$ngpu" --run-dir "$DTRAIN_HOME/ddp" -- \
  python -m dtrain.training.reference.train_digits --epochs 20 2>&1 | grep -E "rank0\]|dtrain\]|Error|error" | tail -5
"$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print('DDP nccl result:', r)" "$DTRAIN_HOME/ddp/metrics/result.json"

for stage in 1 2; do
  step "DeepSpeed ZeRO-$stage on CUDA: 1 node x $ngpu GPU(s)"
  echo "{\"train_micro_batch_size_per_gpu\": 32, \"zero_optimization\": {\"stage\": $stage}, \"steps_per_print\": 100000}" > "$DTRAIN_HOME/ds$stage.json"
  dtrain launch --procs-per-node "$ngpu" --distribution deepspeed --deepspeed-config "$DTRAIN_HOME/ds$stage.json" \
    --run-dir "$DTRAIN_HOME/ds$stage" -- python -m dtrain.training.reference.train_digits --deepspeed --epochs 20 \
    2>&1 | grep -E "rank0\] (world|test)|dtrain\]|Error|error|ZeRO|zero" | tail -6
  "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print('DeepSpeed result:', r)" "$DTRAIN_HOME/ds$stage/metrics/result.json"
done

step "a failing rank on the GPU path propagates its exit code and leaves no process"
dtrain launch --procs-per-node "$ngpu" -- "$PY" -c "import os, sys, torch; torch.zeros(1, device='cuda'); sys.exit(9)"; echo "exit=$? (expected 9)"
sleep 1; ps -eo pid,cmd | grep -E "rank_entry|torch.distributed.run" | grep -v grep || echo "no leftover process"
