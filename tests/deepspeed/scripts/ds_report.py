"""What the DeepSpeed test scripts saw, printed and (with --report-dir) written per rank for the tests."""

import json
import os


def shm_buffer() -> str:
    """Where DeepSpeed's CPU all-reduce keeps this rank's buffer (shm.cpp's name)."""
    return "/dev/shm/deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), os.environ.get("RANK", ""))


def report(args, fields):
    fields = {**fields, "shm_buffer": shm_buffer(), "shm_buffer_existed": os.path.exists(shm_buffer())}
    print(json.dumps(fields), flush=True)
    if args.report_dir:
        with open(os.path.join(args.report_dir, f"report-rank{fields['rank']}.json"), "w") as fh:
            json.dump(fields, fh)
