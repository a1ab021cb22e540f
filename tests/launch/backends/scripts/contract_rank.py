"""The contract suite's training script: records this rank's env contract, argv and pid in
$OUT_DIR/rank<RANK>.json; --fail R C makes rank R exit C once every rank is up; --hang keeps
the other ranks (or all, without --fail) alive until stopped; --escape starts a child that
leaves the rank's session (setsid) and outlives the rank, its pid in $OUT_DIR/escaped<RANK>."""
import json
import os
import subprocess
import sys
import time

KEYS = ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
        "DTRAIN_JOB_ID", "DTRAIN_RUN_DIR", "DTRAIN_CHECKPOINT_DIR", "DTRAIN_METRICS_DIR",
        # the node environment every backend gives (Backend.node_env)
        "DTRAIN_NODE_INDEX", "DTRAIN_STOP_GRACE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
        "DTRAIN_DISTRIBUTION", "DTRAIN_DEVICE", "PYTHONUNBUFFERED", "TF_CONFIG"]

args = sys.argv[1:]
fail = hang = None
if args[:1] == ["--fail"]:
    fail, args = (int(args[1]), int(args[2])), args[3:]
if args[:1] == ["--hang"]:
    hang, args = True, args[1:]
if args[:1] == ["--escape"]:
    args = args[1:]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(os.environ["OUT_DIR"], f"escaped{os.environ['RANK']}"), "w") as fh:
        fh.write(str(child.pid))
out, rank, world = os.environ["OUT_DIR"], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
record = {"env": {k: os.environ.get(k) for k in KEYS}, "argv": args, "pid": os.getpid()}
tmp = os.path.join(out, f".rank{rank}.tmp")
with open(tmp, "w") as fh:
    json.dump(record, fh)
os.replace(tmp, os.path.join(out, f"rank{rank}.json"))
print(f"rank {rank} up", flush=True)
if fail is not None and rank == fail[0]:
    deadline = time.time() + 60
    while len([n for n in os.listdir(out) if n.startswith("rank")]) < world and time.time() < deadline:
        time.sleep(0.05)
    print(f"rank {rank} failing on purpose", flush=True)
    sys.exit(fail[1])
if hang:
    time.sleep(600)
