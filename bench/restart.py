"""Seconds from a rank's death to the first resumed training step: in-job restart vs relaunch.

The same 1 node x 2 process job on the same data (the reference digits script with one fault
injected: tests/launch/engine/faults/scripts/faulty_train.py, rank 1 SIGKILLs itself after step 12;
checkpoints every 5 steps), recovered two ways:

* in-job restart: ``dtrain launch --max-restarts 1``; torchrun restarts the workers, which
  resume from the checkpoint at step 10;
* relaunch: ``dtrain launch --max-restarts 0`` fails, then a second ``dtrain launch`` with the
  same run directory resumes from that checkpoint (what an Airflow retry does, minus the
  scheduler's own delay).

Death: the time the fault script recorded just before killing itself (``fault-fired.json``).
Resumed: the ``time`` of rank 0's first metrics record after the restart (the first record whose
step is not above the one before it, in ``metrics/rank0.jsonl``). The two ways alternate (so load
drifts hit both alike); the median of ``--repeats`` each is printed on one line with the ratio.

    .venv/bin/python bench/restart.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
FAULTY = os.path.join(REPO, "tests", "launch", "engine", "faults", "scripts", "faulty_train.py")
FAULT_STEP, EVERY = 12, 5
TRAIN = [sys.executable, FAULTY, "--fault-rank", "1", "--fault-step", str(FAULT_STEP), "--fault-mode", "sigkill",
         "--", "--epochs", "2", "--checkpoint-every", str(EVERY), "--step-sleep", "0.02"]


def launch(run_dir: str, max_restarts: int, env: dict[str, str]) -> int:
    argv = [os.path.join(BIN, "dtrain"), "launch", "--nodes", "1", "--procs-per-node", "2", "--device", "cpu",
            "--max-restarts", str(max_restarts), "--run-dir", run_dir, "--", *TRAIN]
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    return proc.returncode


def death_to_resumed_step(run_dir: str) -> float:
    with open(os.path.join(run_dir, "fault-fired.json"), encoding="utf-8") as fh:
        died = json.load(fh)["time"]
    with open(os.path.join(run_dir, "metrics", "rank0.jsonl"), encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    for before, record in zip(records, records[1:]):
        if record["step"] <= before["step"]:
            if record["step"] != FAULT_STEP // EVERY * EVERY + 1:
                raise SystemExit(f"{run_dir}: resumed at step {record['step']}, not from the checkpoint")
            return record["time"] - died
    raise SystemExit(f"{run_dir}: rank 0 never resumed")


def in_job_restart(run_dir: str, env: dict[str, str]) -> float:
    code = launch(run_dir, 1, env)
    if code != 0:
        raise SystemExit(f"in-job restart: the job failed ({code}), run dir {run_dir}")
    return death_to_resumed_step(run_dir)


def relaunch(run_dir: str, env: dict[str, str]) -> float:
    code = launch(run_dir, 0, env)
    if code == 0:
        raise SystemExit(f"relaunch: the first launch did not fail, run dir {run_dir}")
    code = launch(run_dir, 0, env)  # the fault fires once per run directory: this one trains to the end
    if code != 0:
        raise SystemExit(f"relaunch: the second launch failed ({code}), run dir {run_dir}")
    return death_to_resumed_step(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-restart-")
    env = dict(os.environ, OMP_NUM_THREADS="1", DTRAIN_HOME=os.path.join(work, "home"),
               PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    times: dict[str, list[float]] = {"in-job": [], "relaunch": []}
    for i in range(args.repeats):
        times["in-job"].append(in_job_restart(os.path.join(work, f"in-job-{i}"), env))
        times["relaunch"].append(relaunch(os.path.join(work, f"relaunch-{i}"), env))
    shutil.rmtree(work)  # kept when a run failed (SystemExit above), for a look at its run directory
    r, l = statistics.median(times["in-job"]), statistics.median(times["relaunch"])
    print(f"restart 1x2 gloo: in-job restart {r:.1f} s, relaunch {l:.1f} s, ratio {r / l:.2f} "
          f"(median of {args.repeats}; death of a rank to its first resumed step)")


if __name__ == "__main__":
    main()
