"""Benchmark: time until every rank of a 2-node x 2-process job runs, SSH backend vs local backend.

The same job on both: ``tests/launch/backends/scripts/ddp_train.py --start-only`` (each rank writes the time
it started and exits). The SSH backend's "hosts" are two real sshd daemons on 127.0.0.1,
started here (as the tests do); the local backend simulates the two nodes on this host.
Runs alternate between the backends; the median of ``--repeats`` runs each is reported.

Prints one line: both medians and their ratio. Needs root (sshd logs in as root with a
generated key) and the openssh-server package.

    .venv/bin/python bench/remote_launch.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dtrain.launch.core.spec import LaunchSpec  # noqa: E402
from dtrain.launch.engine.launcher import Launcher  # noqa: E402
from tests.sshd_cluster import start_cluster  # noqa: E402

SCRIPT = os.path.join(REPO, "tests", "launch", "backends", "scripts", "ddp_train.py")


def time_to_all_ranks(spec: LaunchSpec) -> float:
    """Seconds from the launch call until the last of the ranks had started its script."""
    started = time.time()
    result = Launcher(spec, sink=lambda _line: None).run()
    if result.exit_code != 0:
        raise SystemExit(f"{spec.backend} run failed with {result.exit_code}: {result.tail[-5:]}")
    folder = os.path.join(result.run_dir, "reports")
    stamps = []
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            stamps.append(json.load(fh)["started"])
    if len(stamps) != spec.world_size:
        raise SystemExit(f"{spec.backend}: {len(stamps)} of {spec.world_size} ranks reported")
    return max(stamps) - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="dtrain-bench-remote-")
    os.environ.setdefault("DTRAIN_HOME", os.path.join(work, "home"))
    cluster = start_cluster(os.path.join(work, "sshd"), count=2)
    try:
        hostfile = cluster.hostfile(2)
        command = [sys.executable, SCRIPT, "--start-only"]
        times: dict[str, list[float]] = {"ssh": [], "local": []}
        for i in range(args.repeats):
            for backend in ("local", "ssh"):
                options = {"hostfile": hostfile, **cluster.ssh_settings()} if backend == "ssh" else {}
                spec = LaunchSpec(command=command, nodes=2, procs_per_node=2, backend=backend, device="cpu",
                                  run_dir=os.path.join(work, f"{backend}-{i}"), backend_options=options)
                times[backend].append(time_to_all_ranks(spec))
    finally:
        cluster.stop()
    ssh, local = statistics.median(times["ssh"]), statistics.median(times["local"])
    print(f"remote_launch: time until all 4 ranks run (2 nodes x 2 procs, median of {args.repeats}): "
          f"ssh backend {ssh:.2f} s, local backend {local:.2f} s, ssh/local {ssh / local:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
