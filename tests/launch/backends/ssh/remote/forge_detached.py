"""A hostile rank of a detached SSH job (one rank per node): it forges what the node daemons write
in ``$DTRAIN_RUN_DIR/detached``, as any training code can, then waits to be stopped.

    forge_detached.py exit VALUE      rank 0 writes {"exit_code": VALUE} (VALUE as JSON) as both
                                      nodes' exit records
    forge_detached.py state OTHER     rank 0 copies the other job's run directory's state records
                                      over this job's (real PIDs and start times, of another job)
    forge_detached.py link TARGET     rank 0 swaps both nodes' logs for symlinks to TARGET; then
                                      every rank fails (exit 3)
    forge_detached.py tmplink VICTIM  each rank plants links to VICTIM where its node's daemon
                                      would have put its exit record's temp file; then exits 0

Each writes ``<run dir>/forged-<rank>`` when done, so the test knows the forgery is in place.
"""
import json
import os
import shutil
import sys
import time

mode, arg = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
run_dir = os.environ["DTRAIN_RUN_DIR"]
folder = os.path.join(run_dir, "detached")


def node_file(node: int, suffix: str) -> str:
    return os.path.join(folder, f"node{node}.{suffix}")


def swap_for_link(path: str, target: str) -> None:
    tmp = path + ".forging"
    os.symlink(target, tmp)
    os.replace(tmp, path)


def wait_for_state(node: int) -> dict:
    """The node daemon's state record (it is written before the agent starts: there already)."""
    while True:
        try:
            with open(node_file(node, "state.json"), encoding="utf-8") as fh:
                return json.load(fh)
        except (OSError, ValueError):
            time.sleep(0.05)


if mode == "exit" and rank == 0:
    for node in (0, 1):
        with open(node_file(node, "exit.json"), "w", encoding="utf-8") as fh:
            fh.write('{"exit_code": ' + arg + ', "stopped_by_signal": null}')
elif mode == "state" and rank == 0:
    for node in (0, 1):
        shutil.copyfile(os.path.join(arg, "detached", f"node{node}.state.json"), node_file(node, "state.json"))
elif mode == "link" and rank == 0:
    for node in (0, 1):
        swap_for_link(node_file(node, "log"), arg)
elif mode == "tmplink":
    node = int(os.environ["DTRAIN_NODE_INDEX"])
    pid = wait_for_state(node)["pid"]
    os.symlink(arg, node_file(node, f"exit.json.{pid}.tmp"))  # the name the daemon used to write through
with open(os.path.join(run_dir, f"forged-{rank}"), "w", encoding="utf-8") as fh:
    fh.write(mode)
if mode == "link":
    while not all(os.path.exists(os.path.join(run_dir, f"forged-{r}")) for r in (0, 1)):
        time.sleep(0.05)
    print(f"rank {rank}: failing after the forgery", flush=True)
    sys.exit(3)
if mode == "tmplink":
    sys.exit(0)
time.sleep(600)
