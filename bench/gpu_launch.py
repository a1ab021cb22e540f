"""The GPU path as a user runs it: ``dtrain launch`` of the text example, the digits reference script
with DDP, and with DeepSpeed ZeRO-2, each on one node with every GPU of the host.

Each line gives the job's figure against its bar: the text example's training perplexity against an
untrained model's (the vocabulary size) and its step time against the slowest plain step of the same
run (data wait), the reference script's test accuracy against the demo's bar (0.95), and the count of
NCCL device-guess warnings (none: the process group is made with the rank's device). One more line
checks that a job asking for more processes than the host has GPUs is refused (exit 2) before
anything starts.

    python bench/gpu_launch.py [--device cuda|cpu] [--quick]

``--quick`` runs the same jobs with a few steps on the CPU (gloo), judging no goal: the suite runs it
so that the bench cannot rot.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import Line, judged, part_main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_EXAMPLE = os.path.join(ROOT, "examples", "text")
#: the demo's bar for the digits model's test accuracy
ACCURACY_BAR = 0.95
#: what NCCL prints when a process group is made without a device
DEVICE_GUESS = ("Guessing device ID based on global rank", "using the device under current context")


def _env(device: str) -> dict[str, str]:
    paths = [os.path.join(ROOT, "operators"), TEXT_EXAMPLE, os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), PYTHONUNBUFFERED="1")
    if device == "cpu":
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


def _dtrain(args: list[str], device: str, cwd: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "dtrain.cli", *args]
    return subprocess.run(argv, cwd=cwd, env=_env(device), capture_output=True, text=True, timeout=900)


def _launch(run_dir: str, device: str, cwd: str, procs: int, command: list[str],
            extra: list[str] = ()) -> subprocess.CompletedProcess:
    flag = "gpu" if device == "cuda" else "cpu"
    return _dtrain(["launch", "--procs-per-node", str(procs), "--device", flag, "--run-dir", run_dir, *extra,
                    "--", sys.executable, *command], device, cwd)


def _result(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, "metrics", "result.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _records(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics", "rank0.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def _tail(job: subprocess.CompletedProcess) -> str:
    """The job's last line of output (what a failure says)."""
    output = (job.stdout + job.stderr).strip().splitlines()
    return output[-1][:200] if output else ""


def gpu_count(device: str) -> int:
    import torch

    return torch.cuda.device_count() if device == "cuda" else 2


def refused_line(device: str, workdir: str) -> Line:
    n = gpu_count(device)
    job = _launch(os.path.join(workdir, "refused"), device, workdir, n + 1, ["-c", "pass"]) if device == "cuda" else None
    if job is None:
        return Line("launch: more processes than GPUs", "not applicable on cpu")
    return Line("launch: more processes than GPUs", f"--procs-per-node {n + 1} on {n} GPU(s): exit {job.returncode} "
                f"(expected 2), {_tail(job)!r}", job.returncode == 2)


def text_example_line(device: str, quick: bool, workdir: str) -> Line:
    """Preprocess the text example's documents into packed blocks, train one epoch, read its figures."""
    sys.path.insert(0, TEXT_EXAMPLE)
    from text_pipeline.data import generate_documents, write_jsonl
    from text_pipeline.tokenizer import VOCAB_SIZE

    docs, shards, run_dir = (os.path.join(workdir, name) for name in ("docs.jsonl", "text-shards", "text-run"))
    write_jsonl(docs, generate_documents(60 if quick else 2000, 1))
    prep = _dtrain(["preprocess", "--transform", "text_pipeline.prep:transform", "--input", docs, "--output", shards,
                    "--pack", "input_ids", "--block-size", "64", "--separator", "1"], device, workdir)
    if prep.returncode != 0:
        return Line("launch: text example", f"preprocess exit {prep.returncode}: {_tail(prep)!r}", False)
    epochs, batch = ("1", "8") if quick else ("4", "64")
    job = _launch(run_dir, device, workdir, 1, ["-m", "text_pipeline.train", "--shards", shards, "--output",
                  os.path.join(workdir, "text-model.pt"), "--epochs", epochs, "--batch-size", batch])
    result, records = _result(run_dir), _records(run_dir)
    records = records[5:] or records  # the first steps compile and warm up
    perplexity = result.get("train_perplexity")
    if job.returncode != 0 or perplexity is None or not records:
        return Line("launch: text example", f"exit {job.returncode}: {_tail(job)!r}", False)
    step_ms = statistics.median(r["step_time_s"] for r in records) * 1e3
    wait = sum(r["data_wait_s"] for r in records) / max(sum(r["step_time_s"] for r in records), 1e-9)
    return Line("launch: text example 1 node x 1 proc",
                f"exit 0, {result['steps']} steps, {step_ms:.2f} ms/step median, data wait {wait:.1%}; "
                f"train perplexity {perplexity:.2f} vs untrained {VOCAB_SIZE} (ratio {perplexity / VOCAB_SIZE:.3f})",
                judged(perplexity < VOCAB_SIZE / 4, quick))


def digits_line(device: str, quick: bool, workdir: str, deepspeed: bool) -> Line:
    n = 1 if device == "cuda" else 2
    name = "DeepSpeed ZeRO-2" if deepspeed else "DDP"
    run_dir = os.path.join(workdir, "ds-run" if deepspeed else "ddp-run")
    extra: list[str] = []
    command = ["-m", "dtrain.training.reference.train_digits", "--epochs", "2" if quick else "20"]
    if deepspeed:
        config = os.path.join(workdir, "ds.json")
        with open(config, "w") as f:
            json.dump({"train_micro_batch_size_per_gpu": 32, "zero_optimization": {"stage": 2},
                       "steps_per_print": 100000}, f)
        extra = ["--distribution", "deepspeed", "--deepspeed-config", config]
        command.append("--deepspeed")
    job = _launch(run_dir, device, workdir, n, command, extra)
    output = job.stdout + job.stderr
    guesses = sum(output.count(text) for text in DEVICE_GUESS)
    accuracy = _result(run_dir).get("test_accuracy")
    if job.returncode != 0 or accuracy is None:
        return Line(f"launch: digits {name}", f"exit {job.returncode}: {_tail(job)!r}", False)
    return Line(f"launch: digits {name} 1 node x {n} proc",
                f"exit 0, test accuracy {accuracy:.4f} vs bar {ACCURACY_BAR} (ratio {accuracy / ACCURACY_BAR:.3f}); "
                f"NCCL device-guess warnings {guesses} vs 0",
                judged(accuracy >= ACCURACY_BAR and guesses == 0, quick))


def deepspeed_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def lines(device: str, quick: bool, workdir: str) -> Iterator[Line]:
    yield refused_line(device, workdir)
    yield text_example_line(device, quick, workdir)
    yield digits_line(device, quick, workdir, deepspeed=False)
    if deepspeed_importable():
        yield digits_line(device, quick, workdir, deepspeed=True)
    else:
        yield Line("launch: digits DeepSpeed ZeRO-2", "deepspeed is not installed", False)


if __name__ == "__main__":
    sys.exit(part_main(lines))
