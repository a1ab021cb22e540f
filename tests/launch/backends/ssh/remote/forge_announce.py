"""A hostile rank for the SSH teardown test: it prints look-alike agent announcements naming
the process group $VICTIM_PGID (plain, and with a made-up nonce), then rank 0 fails while the
others hang, so the launcher tears the other host down."""
import os
import sys
import time

victim = os.environ["VICTIM_PGID"]
for node in (0, 1):
    print(f"[dtrain-remote] node={node} pgid={victim} host=x", flush=True)
    print(f"[dtrain-remote] nonce={'0' * 32} node={node} pgid={victim} host=x", flush=True)
    print(f"[node{node}] [dtrain-remote] nonce={'0' * 32} node={node} pgid={victim} host=x", flush=True)
if os.environ["RANK"] == "0":
    time.sleep(2)
    sys.exit(3)
time.sleep(600)
