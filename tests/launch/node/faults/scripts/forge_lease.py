"""A hostile rank: forges node 1's lease records in the run directory for a while, then ends well.

    forge_lease.py beat|fence SECONDS

Rank 0 only (the others wait as long). ``beat``: every half second it back-dates node 1's beat file
(``os.utime``: what the holder wrote, or else a beat of its own, written in its place first every
other time); ``fence``: it writes a fence record for node 1. Stdlib only: it runs as a rank anywhere.
"""

import json
import os
import sys
import time

mode, seconds = sys.argv[1], float(sys.argv[2])
folder = os.path.join(os.environ["DTRAIN_RUN_DIR"], "lease", os.environ["DTRAIN_JOB_ID"])
end = time.time() + seconds
turn = 0
while os.environ.get("RANK") == "0" and time.time() < end:
    os.makedirs(folder, exist_ok=True)
    long_ago = time.time() - 3600
    if mode == "beat":
        beat = os.path.join(folder, "node1.beat")
        if turn % 2 or not os.path.exists(beat):
            with open(beat, "w") as fh:
                json.dump({"time": long_ago}, fh)
        os.utime(beat, (long_ago, long_ago))
    else:
        with open(os.path.join(folder, "node1.fenced"), "w") as fh:
            json.dump({"time": time.time(), "reason": "this node could not reach its peer (forged by rank 0)"}, fh)
    turn += 1
    time.sleep(0.5)
while time.time() < end:
    time.sleep(0.5)
print(f"rank {os.environ.get('RANK')}: done", flush=True)
