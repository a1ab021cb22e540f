"""``python -m dtrain.autotune.ds_runner ARGS...``: DeepSpeed's launcher (``deepspeed ARGS...``), whose
``--autotuning tune`` runs DeepSpeed's autotuner, with its experiment scheduler checking on a running
experiment every :data:`CHECK_INTERVAL_S` seconds instead of every 5.

DeepSpeed's scheduler (``deepspeed/autotuning/scheduler.py``, module constant ``TIMEOUT = 5``) joins
an experiment's thread for up to ``TIMEOUT`` seconds and then sleeps ``TIMEOUT`` seconds more before
it looks again, so after each experiment the nodes stay idle for 5 to 10 s before the next one starts.
Checking a thread is cheap; here the next experiment starts within a second. The constant is read at
every check, so setting it before the launcher runs is all it takes; nothing else of DeepSpeed changes
(its experiments are started as ``deepspeed ...`` by name, as before).
"""

from __future__ import annotations

import sys

#: seconds between the scheduler's looks at a running experiment (DeepSpeed's own: 5)
CHECK_INTERVAL_S = 0.5


def main(argv: list[str] | None = None) -> None:
    from deepspeed.autotuning import scheduler
    from deepspeed.launcher.runner import main as deepspeed_main

    scheduler.TIMEOUT = CHECK_INTERVAL_S
    deepspeed_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
