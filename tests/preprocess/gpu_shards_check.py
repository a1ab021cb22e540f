"""Device check (run by hand where a GPU is lent; CI has none): shards to a CUDA device.

1. preprocess the digits training split into shards (8 worker processes);
2. ShardLoader with pin_memory=True, copied to the GPU with non_blocking=True, equals the CPU read;
3. the reference script trains from the shards on the GPU through the launcher (--device gpu):
   test accuracy >= 0.90; the data-stall report of that run is printed.

    PYTHONPATH=. python3 tests/preprocess/gpu_shards_check.py
Exits non-zero when a check fails.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def main() -> int:
    import torch

    from dtrain.preprocess.examples import write_digits_jsonl
    from dtrain.preprocess.runner import preprocess
    from dtrain.stall_report import format_report, summarize
    from dtrain.training.shards import ShardDataset, ShardLoader, ShardSampler

    assert torch.cuda.is_available(), "no CUDA device"
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    tmp = tempfile.mkdtemp(prefix="gpu-shards-")
    raw = write_digits_jsonl(os.path.join(tmp, "raw"), partitions=4)
    shards = os.path.join(tmp, "shards")
    preprocess(raw, shards, "dtrain.preprocess.examples:digits_features", workers=8, shard_size=128)

    dataset = ShardDataset(shards, verify=True, cache_bytes=0)
    sampler = ShardSampler(len(dataset), num_replicas=1, rank=0)
    gpu = [tuple(t.to("cuda", non_blocking=True) for t in b) for b in ShardLoader(dataset, 64, sampler, pin_memory=True)]
    torch.cuda.synchronize()
    cpu = list(ShardLoader(dataset, 64, sampler))
    assert all(torch.equal(g.cpu(), c) for gb, cb in zip(gpu, cpu) for g, c in zip(gb, cb)), "GPU copy differs"
    print(f"pinned ShardLoader -> cuda: {len(gpu)} batches equal to the CPU read")

    run_dir = os.path.join(tmp, "run")
    from dtrain.launch.engine.launcher import Launcher
    from dtrain.launch.backends.placement import visible_gpu_count
    from dtrain.launch.core.spec import LaunchSpec

    # gpus_per_node stated: the spec's own detection reads /proc/driver/nvidia/gpus, absent in some sandboxes.
    print("visible_gpu_count() from /proc:", visible_gpu_count(), "torch:", torch.cuda.device_count())
    spec = LaunchSpec(command=[sys.executable, "-m", "dtrain.training.reference.train_digits", "--shards", shards,
                               "--epochs", "8"], nodes=1, procs_per_node=1, device="gpu",
                      gpus_per_node=torch.cuda.device_count(), run_dir=run_dir)
    launched = Launcher(spec).run()
    assert launched.ok, f"launch failed with {launched.exit_code}: {launched.tail}"
    result = json.load(open(os.path.join(run_dir, "metrics", "result.json"), encoding="utf-8"))
    print("result:", result)
    print("\n".join(format_report(summarize(os.path.join(run_dir, "metrics")))))
    assert result["test_accuracy"] >= 0.90, result
    print("GPU SHARD CHECK OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
