"""The join benchmark's rank: imports torch, joins a gloo process group, and writes when each
ended (time.time()) to $JOIN_OUT/rank<RANK>.json."""
import json
import os
import time

import torch
import torch.distributed as dist

imported = time.time()
dist.init_process_group("gloo")
joined = time.time()
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
with open(os.path.join(os.environ["JOIN_OUT"], f"rank{os.environ['RANK']}.json"), "w") as fh:
    json.dump({"imported": imported, "joined": joined}, fh)
