"""Benchmark: how launching, stopping and watching an SSH job grow with the host count.

For N = 2, 4, 8, 16, 32 simulated hosts (real sshd daemons on 127.0.0.1, one port each, as the
tests start them) and 1 process per host running a tiny gloo job (join, all-reduce once,
idle), the job is started detached (what a deferrable or durable task does), and this prints:

* ``start_s``: until the submit returned (every host's node daemon started over ssh: the
  launcher's own part, bounded by the fan-out);
* ``launch_s``: from submit until every rank has joined the group and all-reduced;
* ``peak_procs``: the most processes this (launching) process had below it during the start;
* ``teardown_s``: from the cancel until no process of the job is left on any host;
* the triggerer's cost of following the deferred job, per minute, measured over a window
  (``--window`` seconds, CPU seconds of the process and its children, processes spawned):
  ``ssh-poll``: a watcher that asks every host over ssh (``detached_node status``, all at once,
  every 2 s), reproduced in this bench; ``trigger``: the product's ``DistributedJobTrigger``, run
  for real (heartbeats and exit records read from the shared run directory, ssh only for a stale
  host, poll interval 2 s growing by half up to 30 s).

One table, then the slopes (least squares over N). All hosts share the cores of the machine the
bench runs on, so the launch includes N torchrun agents and N ranks importing torch on those cores:
on a 2-core machine that, not ssh, dominates at large N; on real hosts each imports on its own CPUs.

    .venv/bin/python bench/scale.py [--hosts 2,4,8,16,32] [--window 20] [--fanout 32]

Needs root (sshd logs in as root with a generated key) and the openssh-server package.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import psutil  # noqa: E402

from dtrain.launch.airflow.trigger import DistributedJobTrigger  # noqa: E402
from dtrain.launch.backends.base import run_async  # noqa: E402
from dtrain.launch.backends.ssh import detached as nodes  # noqa: E402
from dtrain.launch.core.spec import LaunchSpec  # noqa: E402
from dtrain.launch.engine.launcher import Launcher  # noqa: E402
from tests.sshd_cluster import start_cluster  # noqa: E402
from tests.support import poll_until  # noqa: E402

RANK = os.path.join(REPO, "bench", "scripts", "scale_rank.py")
SPAWNED = [0]  # processes the event loop started (ssh clients): counted by the wrapper below


def count_spawns() -> None:
    original = asyncio.create_subprocess_exec

    async def counting(*args, **kwargs):
        SPAWNED[0] += 1
        return await original(*args, **kwargs)

    asyncio.create_subprocess_exec = counting


def cpu_seconds() -> float:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


class PeakChildren:
    """Samples how many processes run below this one (every 20 ms) while in the ``with``, leaving
    out the simulated hosts' sshd daemons and their sessions (the hosts' side, not this host's)."""

    def __init__(self, hosts: set[int]):
        self.peak, self.hosts, self._stop = 0, hosts, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _count(self) -> int:
        total = 0
        for child in psutil.Process().children():
            if child.pid not in self.hosts:
                total += 1 + len(child.children(recursive=True))
        return total

    def _sample(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._count())
            except psutil.Error:
                pass
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def job_processes(job_id: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if job_id in " ".join(proc.info["cmdline"] or ()) or proc.environ().get("DTRAIN_JOB_ID") == job_id:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        except psutil.Error:
            continue
    return found


async def ssh_poll(handle, stop_at: float) -> None:
    """A watcher without the shared run directory: every host asked over ssh, all at once, every 2 s."""
    target = nodes.Target(hosts=tuple(handle.data["hosts"]), ssh=dict(handle.data["ssh"]))
    while time.monotonic() < stop_at:
        results = await asyncio.gather(*(run_async(argv, 40) for argv in nodes.status_argvs(target, handle.run_dir)))
        status = nodes.decide([nodes.parse_status(i, *r) for i, r in enumerate(results)])
        if status.done:
            raise SystemExit(f"the job ended while being watched: {status}")
        await asyncio.sleep(max(0.0, min(2.0, stop_at - time.monotonic())))


async def product_trigger(handle, stop_at: float) -> None:
    trigger = DistributedJobTrigger(handle=handle.to_dict(), poll_interval=handle.data["poll_interval"],
                                    max_poll_interval=handle.data["max_poll_interval"])
    trigger.log.disabled = True

    async def follow():
        async for event in trigger.run():
            raise SystemExit(f"the job ended while being watched: {event.payload}")

    try:
        await asyncio.wait_for(follow(), timeout=stop_at - time.monotonic())
    except asyncio.TimeoutError:
        pass


def watch_cost(watch, handle, window: float) -> tuple[float, float]:
    """(CPU seconds, processes spawned) per minute of following the job with ``watch``."""
    cpu0, spawned0 = cpu_seconds(), SPAWNED[0]
    asyncio.run(watch(handle, time.monotonic() + window))
    return (cpu_seconds() - cpu0) * 60 / window, (SPAWNED[0] - spawned0) * 60 / window


def measure(n: int, work: str, window: float, fanout: int) -> dict:
    cluster = start_cluster(os.path.join(work, f"sshd-{n}"), count=n)
    handle = None
    try:
        spec = LaunchSpec(command=[sys.executable, RANK], nodes=n, procs_per_node=1, backend="ssh", device="cpu",
                          run_dir=os.path.join(work, f"run-{n}"), stop_grace=2, rdzv_timeout=600,
                          backend_options={"hostfile": cluster.hostfile(1), **cluster.ssh_settings(),
                                           "fanout": fanout, "max_poll_interval": 30})
        launcher = Launcher(spec, sink=lambda _line: None)
        running = os.path.join(spec.run_dir, "running")
        started = time.time()
        with PeakChildren({host.proc.pid for host in cluster.hosts}) as peak:
            handle = launcher.submit_detached()
        submitted = time.time() - started
        if not poll_until(lambda: os.path.isdir(running) and len(os.listdir(running)) == n, timeout=900, interval=0.1):
            raise SystemExit(f"N={n}: only {len(os.listdir(running)) if os.path.isdir(running) else 0} ranks ran")
        launch = max(float(open(os.path.join(running, f)).read()) for f in os.listdir(running)) - started
        time.sleep(1)  # let the ranks settle into their idle loop: the windows below measure the watcher
        before = watch_cost(ssh_poll, handle, window)
        after = watch_cost(product_trigger, handle, window)
        stop_started = time.monotonic()
        launcher.backend.cancel(handle, grace=2)
        if not poll_until(lambda: not job_processes(handle.job_id), timeout=120, interval=0.05):
            raise SystemExit(f"N={n}: processes of the job are left after the cancel")
        teardown = time.monotonic() - stop_started
        return {"n": n, "start": submitted, "launch": launch, "peak": peak.peak, "teardown": teardown, "before": before, "after": after}
    finally:
        if handle is not None:
            for proc in job_processes(handle.job_id):
                proc.kill()
        cluster.stop()


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="2,4,8,16,32", help="host counts, comma-separated")
    p.add_argument("--window", type=float, default=20.0, help="seconds each watcher follows the job")
    p.add_argument("--fanout", type=int, default=32, help="ssh clients at once (the backend's default: 32)")
    args = p.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    work = tempfile.mkdtemp(prefix="dtrain-bench-scale-")
    os.environ.setdefault("DTRAIN_HOME", os.path.join(work, "home"))
    count_spawns()
    rows = []
    print(f"{'hosts':>5} {'start_s':>7} {'launch_s':>9} {'peak_procs':>10} {'teardown_s':>10} "
          f"{'ssh-poll cpu_s/min':>18} {'ssh-poll procs/min':>18} {'trigger cpu_s/min':>17} {'trigger procs/min':>17}", flush=True)
    for n in counts:
        r = measure(n, work, args.window, args.fanout)
        rows.append(r)
        print(f"{n:>5} {r['start']:>7.2f} {r['launch']:>9.2f} {r['peak']:>10} {r['teardown']:>10.2f} {r['before'][0]:>18.2f} "
              f"{r['before'][1]:>18.0f} {r['after'][0]:>17.3f} {r['after'][1]:>17.0f}", flush=True)
    xs = [float(r["n"]) for r in rows]
    if len(rows) >= 2:
        print(f"slope per host: start {slope(xs, [r['start'] for r in rows]):+.3f} s, launch {slope(xs, [r['launch'] for r in rows]):+.3f} s, "
              f"teardown {slope(xs, [r['teardown'] for r in rows]):+.3f} s, "
              f"triggerer ssh-poll {slope(xs, [r['before'][0] for r in rows]):+.3f} cpu_s/min and "
              f"{slope(xs, [r['before'][1] for r in rows]):+.1f} procs/min, "
              f"trigger {slope(xs, [r['after'][0] for r in rows]):+.4f} cpu_s/min and "
              f"{slope(xs, [r['after'][1] for r in rows]):+.1f} procs/min")
    last = rows[-1]
    print(f"scale: triggerer cost following one deferred {last['n']}-host job: ssh poll of every host "
          f"{last['before'][0]:.2f} cpu_s/min, {last['before'][1]:.0f} procs/min; DistributedJobTrigger "
          f"{last['after'][0]:.3f} cpu_s/min, {last['after'][1]:.0f} procs/min; "
          f"{last['before'][0] / max(last['after'][0], 1e-3):.0f}x less CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
