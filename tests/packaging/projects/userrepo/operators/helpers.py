"""The user's helpers: write one JSON record per rank, with a marker proving which package ran."""

import json
import os
import sys

MARKER = "user-operators-package"


def write_record(mode: str) -> str:
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")}
    try:  # the process that started this rank: dtrain's rank_entry wrapper under torchrun
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            parent = [part.decode() for part in fh.read().split(b"\0") if part]
    except OSError:
        parent = []
    record = {"env": env, "marker": MARKER, "mode": mode, "helpers_file": os.path.abspath(__file__),
              "executable": sys.executable, "cwd": os.getcwd(), "parent_cmdline": parent}
    path = os.path.join(os.environ["OUT_DIR"], f"rank{env['RANK']}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh)
    os.replace(path + ".tmp", path)
    return path
