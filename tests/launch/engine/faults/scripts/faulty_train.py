"""The package's reference training script, unchanged, with ONE injected fault.

    faulty_train.py [--fault-rank R] [--fault-step S] [--fault-mode sigkill|exit3] -- TRAIN_DIGITS_ARGS...

(or the same through FAULT_RANK / FAULT_STEP / FAULT_MODE in the environment). Rank R,
right after it finished training step S, dies: ``sigkill`` sends SIGKILL to itself,
``exit3`` exits with status 3. Everything else is
:func:`dtrain.training.reference.train_digits.main` as shipped.

The fault fires once per run directory, across restarts and relaunches: before dying the
rank creates ``$DTRAIN_RUN_DIR/fault-fired.json`` exclusively (O_EXCL), holding the rank,
the step, the mode and ``time``, the wall-clock time just before the kill (the restart
benchmark measures from it). A rank that finds the file trains normally.

Pick a checkpoint interval smaller than S, and S not a multiple of it: the checkpoint the
job resumes from is then the last multiple of the interval below S, whichever rank dies.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

MARKER = "fault-fired.json"


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fault-rank", type=int, default=int(os.environ.get("FAULT_RANK", "0")))
    p.add_argument("--fault-step", type=int, default=int(os.environ.get("FAULT_STEP", "0")),
                   help="the step after which the rank dies (0: no fault)")
    p.add_argument("--fault-mode", choices=("sigkill", "exit3"), default=os.environ.get("FAULT_MODE", "sigkill"))
    if "--" in argv:
        cut = argv.index("--")
        return p.parse_args(argv[:cut]), argv[cut + 1:]
    return p.parse_known_args(argv)


def marker_path() -> str:
    return os.path.join(os.environ.get("DTRAIN_RUN_DIR") or os.getcwd(), MARKER)


def claim(record: dict) -> bool:
    """Create the marker, exclusively; False if a rank already fired in this run directory."""
    try:
        fd = os.open(marker_path(), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(record, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return True


def install(fault_rank: int, fault_step: int, mode: str) -> None:
    from dtrain.training.metrics import StepRecorder

    original = StepRecorder.record
    rank = int(os.environ.get("RANK", "0"))

    # The reference script records every step as it ends (its metrics lines are written later, in
    # chunks read from the device): the fault fires right after step S, not when S's line is written.
    def record(self, *, step: int, **fields):
        original(self, step=step, **fields)
        if step != fault_step or rank != fault_rank:
            return
        if not claim({"rank": rank, "step": step, "mode": mode, "pid": os.getpid(),
                      "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "time": time.time()}):
            return
        print(f"fault: rank {rank} dies after step {step} ({mode})", flush=True)
        sys.stderr.flush()
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        # Not sys.exit: interpreter teardown with a live gloo process group sometimes aborts
        # (std::terminate, exit 134), and the test wants the status the script chose.
        os._exit(3)

    StepRecorder.record = record


def main(argv: list[str] | None = None) -> int:
    opts, rest = parse(list(sys.argv[1:] if argv is None else argv))
    if opts.fault_step > 0:
        install(opts.fault_rank, opts.fault_step, opts.fault_mode)
    from dtrain.training.reference import train_digits

    return train_digits.main(rest)


if __name__ == "__main__":
    from dtrain.training.dist import exit_now

    exit_now(main())  # as the reference script does: no interpreter teardown after a finished run
