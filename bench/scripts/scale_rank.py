"""The scale benchmark's rank: join a gloo group, all-reduce once, record that it runs, then
idle (the benchmark watches the job, then cancels it)."""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
folder = os.path.join(os.environ["DTRAIN_RUN_DIR"], "running")
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, f"rank{dist.get_rank()}"), "w") as fh:
    fh.write(repr(time.time()))
time.sleep(900)
