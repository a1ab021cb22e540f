"""Real training with the reference script: DDP accuracy, DeepSpeed ZeRO on CPU, kill and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher

from ..conftest import alive, wait_for

DTRAIN = os.path.join(os.path.dirname(sys.executable), "dtrain")
TRAIN = ["python", "-m", "dtrain.training.reference.train_digits"]
README_ACCURACY = 0.95  # README states "about 0.99"; asserting a margin below it


def run(spec: LaunchSpec):
    lines: list[str] = []
    result = Launcher(spec, sink=lines.append).run()
    assert result.exit_code == 0, "\n".join(lines[-40:])
    return result, lines


def test_ddp_two_nodes_by_two_reaches_stated_accuracy(tmp_path):
    result, lines = run(LaunchSpec(command=TRAIN + ["--epochs", "20"], nodes=2, procs_per_node=2,
                                   run_dir=str(tmp_path / "run")))
    metrics = result.metrics
    assert metrics["world_size"] == 4 and metrics["distribution"] == "pytorch"
    assert metrics["test_accuracy"] >= README_ACCURACY
    assert metrics["lr"] == pytest.approx(0.05 * 128 / 32)  # linear scaling: base 0.05 at batch 32, global 128
    assert os.path.isfile(metrics["model_path"])
    per_rank = [tmp_path / "run" / "metrics" / f"rank{r}.jsonl" for r in range(4)]
    steps = [len(p.read_text().splitlines()) for p in per_rank]
    assert steps == [metrics["steps"]] * 4
    first = json.loads(per_rank[0].read_text().splitlines()[0])
    assert {"step", "loss", "samples_per_s", "data_wait_s", "step_time_s"} <= set(first)
    # The data-stall report comes back with the result (and so through XCom) and into the log.
    assert len(result.stall["ranks"]) == 4
    assert all(0 <= r["data_wait_fraction"] <= 1 and r["samples_per_s"] > 0 for r in result.stall["ranks"])
    assert result.to_xcom()["stall"] == json.loads(json.dumps(result.stall))
    assert any(line.startswith("[stall]") for line in lines)


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero_on_cpu_trains(tmp_path, stage):
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    result, lines = run(LaunchSpec(command=TRAIN + ["--deepspeed", "--epochs", "8", "--checkpoint-every", "1000"],
                                   procs_per_node=2, distribution="deepspeed", deepspeed_config=config,
                                   run_dir=str(tmp_path / "run")))
    assert result.metrics["distribution"] == "deepspeed"
    assert result.metrics["global_batch"] == 32  # derived: 16 x 1 x 2
    assert result.metrics["test_accuracy"] >= 0.9
    with open(os.path.join(result.run_dir, "deepspeed_config.json")) as fh:
        assert json.load(fh)["zero_optimization"]["stage"] == stage
    assert result.metrics["zero_stage"] == stage  # what the DeepSpeed engine reports it ran


def test_kill_mid_training_then_relaunch_resumes_from_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    argv = [DTRAIN, "launch", "--nodes", "1", "--procs-per-node", "2", "--run-dir", str(run_dir), "--",
            *TRAIN, "--epochs", "6", "--checkpoint-every", "10"]
    first = subprocess.Popen(argv + ["--step-sleep", "0.05"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = run_dir / "checkpoints" / "latest"

    def checkpointed_step():
        try:
            step = int(latest.read_text().strip()[5:13])
        except (OSError, ValueError):
            return None
        return step if step >= 20 else None

    killed_at = wait_for(checkpointed_step, timeout=180, what="a checkpoint at step >= 20")
    import psutil
    tree = [p.pid for p in psutil.Process(first.pid).children(recursive=True)]
    first.send_signal(signal.SIGKILL)  # no chance to clean up or to finish
    first.wait()
    wait_for(lambda: not alive(tree), timeout=30, what="the killed job's processes to exit")
    assert not (run_dir / "metrics" / "result.json").exists()

    second = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    result = json.loads((run_dir / "metrics" / "result.json").read_text())
    assert result["resumed_from_step"] >= killed_at
    train_samples = int(1797 * 0.8)  # digits, 80/20 split
    assert result["steps"] == (train_samples // 2 // 32) * 6  # per-rank batches of 32, 6 epochs
    assert "resumed from checkpoint at step" in second.stdout
    assert result["test_accuracy"] >= 0.9
    leftovers = [n for n in os.listdir(run_dir / "checkpoints") if n.endswith(".tmp")]
    assert leftovers == []
