"""Every rank records its pid; rank FAIL_RANK exits FAIL_CODE once all ranks are up, the others hang."""
import os
import sys
import time

out, rank, world = os.environ["OUT_DIR"], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
with open(os.path.join(out, f"pid{rank}"), "w") as fh:
    fh.write(str(os.getpid()))
if rank == int(os.environ.get("FAIL_RANK", "-1")):
    deadline = time.time() + 60
    while len([n for n in os.listdir(out) if n.startswith("pid")]) < world and time.time() < deadline:
        time.sleep(0.05)
    print("rank failing on purpose", flush=True)
    sys.exit(int(os.environ["FAIL_CODE"]))
print(f"rank {rank} hanging", flush=True)
time.sleep(600)
