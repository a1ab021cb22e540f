"""A rank that looks for its bootstrap store before it imports torch (a raw TCP connect to
MASTER_ADDR:MASTER_PORT), writes what it found to <out>/attempt<A>-rank<R>.json, then joins the
process group through that store. On the first attempt every rank then exits 1 (the agents restart
the workers); on the next one they exit 0."""

import json
import os
import socket
import sys

out = sys.argv[1]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
try:
    with socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=5):
        listening = True
except OSError:
    listening = False
with open(os.path.join(out, f"attempt{attempt}-rank{os.environ['RANK']}.json"), "w") as fh:
    json.dump({"listening": listening, "port": os.environ["MASTER_PORT"],
               "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"]}, fh)

import torch.distributed as dist  # noqa: E402 (after the look: the store must be there before this)

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
sys.exit(1 if attempt == 0 else 0)
