"""Writes this rank's env contract, argv and pid to $OUT_DIR/rank<RANK>.json."""
import json
import os
import sys

out = os.environ["OUT_DIR"]
keys = ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
        "DTRAIN_RUN_DIR", "DTRAIN_CHECKPOINT_DIR", "DTRAIN_METRICS_DIR"]
record = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:], "pid": os.getpid()}
tmp = os.path.join(out, f".rank{os.environ['RANK']}.tmp")
with open(tmp, "w") as fh:
    json.dump(record, fh)
os.replace(tmp, os.path.join(out, f"rank{os.environ['RANK']}.json"))
print(f"rank {os.environ['RANK']} wrote its contract")
