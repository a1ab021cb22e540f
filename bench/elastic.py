"""Time lost per node loss: elastic continuation vs relaunch from checkpoint, on the namespace cluster.

The same job both ways, on the same 3 hosts (tests/netcluster.py: network namespaces, an sshd on
each; one cluster for the whole bench): the package's reference script (``train_digits``,
checkpoint every ``EVERY`` steps, ``--step-sleep`` so the job lasts), ssh backend, 1 process a node,
cpu, ``lost_after`` 12 s, ``stop_grace`` 2 s, a fresh run directory each time. Once rank 0 logged
step ``FAULT_STEP`` (a checkpoint at step ``EVERY`` exists), host 2 crashes (``net.crash``: every
process of the host killed), and the job recovers:

* **elastic**: ``nodes="2:3"``; the launch goes on by itself: hosts 0 and 1 form the next round and
  resume from the checkpoint at world size 2 (one launch, exit 0);
* **relaunch**: ``nodes=3`` (fixed); the launch ends with the lost-node verdict (exit 255); then a
  second launch, ``nodes=2`` on a hostfile of hosts 0 and 1 (the survivors), same run directory,
  resumes from the checkpoint, in the same process at once: what an Airflow retry does once the
  hostfile is fixed, less what Airflow itself takes to get from the failed try to the next try's code.
  That part is measured in the same bench run (below) and added: the relaunch's figure is the
  in-process relaunch's time lost plus the median Airflow retry overhead.

The Airflow retry overhead: before the cluster starts, a real Airflow (tests/airflow_services.py:
api-server, scheduler with its LocalExecutor, dag-processor, on SQLite; no triggerer, a retry does not
use it) runs the probe DAG ``bench/dags/retry_probe.py`` ``--probes`` times: one task, ``retries=1``,
``retry_delay`` as the pipeline factory sets it (``RETRY_DELAY``, 10 s), whose first try fails at once and
whose second succeeds at once; each try writes the
time its callable starts (and the first, the time just before it raises). Per run, the overhead is from
the first try's raise to the second try's callable start (the second launch's start in the in-process
relaunch follows the first's end at once), in three parts, the dates from the REST API's tries endpoint:
*end* (raise to the try's ``end_date``, which the task runner stamps as it catches the error: near 0),
*between tries* (``end_date`` to the next try's ``start_date``: the failure reported, the try's
processes ended, the scheduler finds the try up for retry and queues it, the executor forks a worker,
whose supervisor stamps ``start_date`` as the task process starts) and *start-up* (``start_date`` to the
callable: the task process parses the DAG file, which imports the training operator, and builds the
task's context). Then Airflow is stopped (nothing of it runs while the jobs are timed). Still
favouring the relaunch: the factory's ``retry_delay`` (Airflow's own default is 5 min), the test setup's
scheduler idle sleep of 0.25 s (Airflow's default 1 s), a hostfile fixed instantly (a
real edit, by a person or a tool, costs more), and the operator's own work before its launch starts
(not in the probe).

Time lost: from the fault (the wall-clock time just before ``net.crash``) until rank 0 (its
``metrics/rank0.jsonl`` records: ``step``, ``time``) has trained past the highest step it had logged
before the job resumed, i.e. the first record after the resume (the step counter goes back to the
checkpoint's) whose step is above that peak: downtime plus redone steps, the same way for both. The
hosts' sshd is started again (a reboot: same keys, same address) after each crash. The two ways
alternate (the order swaps every repetition, so load drifts hit both alike); per-repetition figures
(the relaunch's as in-process + Airflow retry), then one line with the median of each, their ratio (the
goal: elastic loses at most half as much), and two ratios that favour the relaunch more: against the
relaunch with Airflow's retry machinery but no ``retry_delay`` at all, and against the in-process
relaunch alone.

Needs root (namespaces, sshd). Nothing is left behind: Airflow is stopped after the probes, the
cluster is removed at the end, and the run directories (and Airflow's home) with them unless a run
failed (then kept, with the launches' and Airflow's logs, for a look).

    .venv/bin/python bench/elastic.py [--repeats 3] [--probes 3] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dtrain.launch.core.elastic import latest_step  # noqa: E402
from dtrain.launch.core.spec import LaunchSpec  # noqa: E402
from dtrain.launch.engine.launcher import Launcher, LaunchResult  # noqa: E402
from tests.airflow_services import AirflowServices, bundle  # noqa: E402
from tests.launch.airflow.faults.airflow_fixtures import tries  # noqa: E402
from tests.netcluster import PREFIX, NetCluster, leftovers  # noqa: E402
from tests.sshd_cluster import SSHCluster, start_cluster  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import job_pids  # noqa: E402  (bench/faults.py: the same look for a job's processes)
from dtrain.pipeline.factory import RETRY_DELAY  # noqa: E402

HOSTS, VICTIM = 3, 2
EVERY, FAULT_STEP = 10, 15  # checkpoint every 10 steps; the fault once rank 0 logged step 15 (5 steps to redo)
STEP_SLEEP = 0.1
#: 2 epochs: 28 steps at world size 3, 44 at world size 2 (1437 samples, 32 a rank): the job ends a few
#: seconds after the measurement, by itself (its exit status is checked)
TRAIN = [sys.executable, "-m", "dtrain.training.reference.train_digits", "--epochs", "2",
         "--step-sleep", str(STEP_SLEEP), "--checkpoint-every", str(EVERY)]
LOST_AFTER, STOP_GRACE = 12.0, 2.0
JOB_TIMEOUT = 240  # seconds one launch may take before the bench gives up on it
PROBE_DAGS = os.path.join(REPO, "bench", "dags")
PROBE_DAG, PROBE_TASK = "bench_retry_probe", "probe"  # bench/dags/retry_probe.py
PROBE_TIMEOUT = 300  # seconds one probe run may take


class Run:
    """``Launcher(spec).run()`` in a thread, its lines in memory (with the time each came) and in ``log``."""

    def __init__(self, spec: LaunchSpec, log: str):
        self.lines: list[str] = []
        self.times: list[float] = []
        self.log = open(log, "a", encoding="utf-8")
        self.launcher = Launcher(spec, sink=self._sink)
        self.results: list[LaunchResult] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _sink(self, line: str) -> None:
        now = time.time()
        self.lines.append(line)
        self.times.append(now)
        self.log.write(f"{now:.2f} {line}\n")
        self.log.flush()

    def _run(self) -> None:
        try:
            self.results.append(self.launcher.run())
        except BaseException as e:  # noqa: BLE001 (reported by result())
            self.error = e

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def when(self, text: str) -> float | None:
        """The time the first line with ``text`` came."""
        return next((t for line, t in zip(self.lines, self.times) if text in line), None)

    def result(self, what: str) -> LaunchResult:
        self.thread.join(JOB_TIMEOUT)
        if self.thread.is_alive():
            self.launcher.terminate()
            self.thread.join(60)
            raise SystemExit(f"{what}: the launch did not end within {JOB_TIMEOUT} s; see {self.log.name}")
        self.log.close()
        if self.error is not None:
            raise SystemExit(f"{what}: the launch raised {self.error!r}; see {self.log.name}")
        return self.results[0]


def spec(cluster: SSHCluster, nodes, hostfile: str, run_dir: str) -> LaunchSpec:
    return LaunchSpec(command=TRAIN, nodes=nodes, procs_per_node=1, backend="ssh", device="cpu", run_dir=run_dir,
                      stop_grace=STOP_GRACE, env={"OMP_NUM_THREADS": "1"},
                      backend_options={"hostfile": hostfile, **cluster.ssh_settings(), "lost_after": LOST_AFTER})


def records(run_dir: str) -> list[dict]:
    """Rank 0's metrics records so far, in the order written (a record still being written is left out)."""
    try:
        with open(os.path.join(run_dir, "metrics", "rank0.jsonl"), encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.endswith("\n")]
    except FileNotFoundError:
        return []


def crash_at_fault_step(net: NetCluster, run: Run, run_dir: str, what: str) -> float:
    """Crash host VICTIM once rank 0 logged FAULT_STEP and the checkpoint at EVERY exists; the time just before."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (max((r["step"] for r in records(run_dir)), default=0) >= FAULT_STEP and latest_step(run_dir) >= EVERY):
        if not run.thread.is_alive() or time.monotonic() > deadline:
            raise SystemExit(f"{what}: rank 0 did not reach step {FAULT_STEP}; see {run.log.name}")
        time.sleep(0.02)
    fault = time.time()
    net.crash(VICTIM)
    return fault


def time_lost(run_dir: str, fault: float, what: str) -> tuple[float, int, int]:
    """(seconds from the fault until rank 0 trained past its peak, the peak, the step it resumed from)."""
    found = records(run_dir)
    for i, (before, record) in enumerate(zip(found, found[1:]), start=1):
        if record["time"] > fault and record["step"] <= before["step"]:  # the resume: the counter went back
            peak = max(r["step"] for r in found[:i])
            for later in found[i:]:
                if later["step"] > peak:
                    return later["time"] - fault, peak, record["step"] - 1
            raise SystemExit(f"{what}: rank 0 resumed at step {record['step']} but never passed step {peak} ({run_dir})")
    raise SystemExit(f"{what}: rank 0 never resumed after the fault ({run_dir})")


def elastic(cluster: SSHCluster, net: NetCluster, run_dir: str) -> tuple[float, str]:
    """nodes=2:3 on the 3 hosts; host 2 crashes; the job goes on on hosts 0 and 1 and ends by itself."""
    run = Run(spec(cluster, f"2:{HOSTS}", cluster.hostfile(1), run_dir), run_dir + ".log")
    deadline = time.monotonic() + JOB_TIMEOUT
    while not run.said("[dtrain] round 0: "):
        if not run.thread.is_alive() or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not run.said(f"[dtrain] round 0: {HOSTS} node(s)"):
        run.launcher.terminate()
        run.thread.join(60)
        raise SystemExit(f"elastic: round 0 did not form on {HOSTS} nodes; see {run.log.name}")
    fault = crash_at_fault_step(net, run, run_dir, "elastic")
    result = run.result("elastic")
    rounds = [sorted(r["nodes"]) for r in result.rounds]
    if result.exit_code != 0 or rounds[:2] != [[0, 1, 2], [0, 1]]:
        raise SystemExit(f"elastic: exit {result.exit_code}, rounds {rounds}; see {run.log.name}")
    lost, peak, resumed = time_lost(run_dir, fault, "elastic")
    formed = run.when("[dtrain] round 1: ")
    return lost, f"peak step {peak}, round 1 formed after {formed - fault:.1f} s, from step {resumed}"


def relaunch(cluster: SSHCluster, net: NetCluster, run_dir: str) -> tuple[float, str]:
    """nodes=3 on the 3 hosts; host 2 crashes: the lost-node verdict; then nodes=2 on hosts 0 and 1, same run dir."""
    first = Run(spec(cluster, HOSTS, cluster.hostfile(1), run_dir), run_dir + ".log")
    fault = crash_at_fault_step(net, first, run_dir, "relaunch")
    result = first.result("relaunch (first launch)")
    if result.exit_code != 255 or (result.lost or {}).get("node") != VICTIM:
        raise SystemExit(f"relaunch: the first launch ended with {result.exit_code} ({result.lost}), not node "
                         f"{VICTIM}'s lost-node verdict; see {first.log.name}")
    ended = time.time() - fault
    verdict = (first.when(f"[dtrain] node {VICTIM} ({cluster.hosts[VICTIM].address}) lost: ") or time.time()) - fault
    survivors = os.path.join(os.path.dirname(run_dir), "hostfile-survivors")
    with open(survivors, "w", encoding="utf-8") as fh:
        fh.writelines(f"root@{host.line} slots=1\n" for i, host in enumerate(cluster.hosts) if i != VICTIM)
    second = Run(spec(cluster, HOSTS - 1, survivors, run_dir), run_dir + ".log")
    result = second.result("relaunch (second launch)")
    if result.exit_code != 0:
        raise SystemExit(f"relaunch: the second launch failed ({result.exit_code}); see {second.log.name}")
    lost, peak, resumed = time_lost(run_dir, fault, "relaunch")
    return lost, (f"peak step {peak}, verdict after {verdict:.1f} s, first launch ended after {ended:.1f} s, "
                  f"relaunch from step {resumed}")


def airflow_pids(home: str) -> list[int]:
    """Live processes of the bench's Airflow (they carry its AIRFLOW_HOME)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get("AIRFLOW_HOME") == home:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def stamp(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def airflow_retry_overhead(work: str, probes: int) -> list[dict[str, float]]:
    """Start Airflow, run the probe DAG ``probes`` times, stop Airflow; per run, the retry's parts
    (seconds: end, between tries, start-up) and their total (the failed try's raise to the next
    try's callable)."""
    home = os.path.join(work, "airflow")
    env = dict(os.environ, AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT="60")  # as tests/pipeline: a loaded API server
    services = AirflowServices(home, env, PROBE_DAGS, [bundle("bench-dags", PROBE_DAGS)])
    found = []
    try:
        services.migrate()
        for name in ("api-server", "scheduler", "dag-processor"):
            services.spawn(name, name)
        services.wait_ready(PROBE_DAG)
        for i in range(probes):
            out = os.path.join(work, f"probe-{i}.jsonl")
            run_id = f"probe-{i}"
            services.trigger(PROBE_DAG, run_id, {"out": out})
            run = services.wait_run(PROBE_DAG, run_id, timeout=PROBE_TIMEOUT)
            done = tries(services, PROBE_DAG, run_id, PROBE_TASK)
            states = [(t["try_number"], t["state"]) for t in done]
            if run["state"] != "success" or states != [(1, "failed"), (2, "success")]:
                raise SystemExit(f"retry probe {run_id}: run {run['state']}, tries {states}; Airflow's home: {home}\n"
                                 + services.failure_report(PROBE_DAG, run_id))
            with open(out, encoding="utf-8") as fh:
                notes = {(n["try"], n["event"]): n["time"] for n in map(json.loads, fh)}
            first, second = done
            parts = {"end": stamp(first["end_date"]) - notes[(1, "fail")],
                     "between tries": stamp(second["start_date"]) - stamp(first["end_date"]),
                     "start-up": notes[(2, "start")] - stamp(second["start_date"])}
            parts["total"] = notes[(2, "start")] - notes[(1, "fail")]
            found.append(parts)
            print(f"  airflow retry probe {i + 1}: {parts['total']:.2f} s (end {parts['end']:.2f} s, "
                  f"between tries {parts['between tries']:.2f} s, start-up {parts['start-up']:.2f} s)", flush=True)
    finally:
        services.stop()
        left = airflow_pids(home)
        if left:
            print(f"  left behind by Airflow: {', '.join(f'pid {pid}' for pid in left)}", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probes", type=int, default=3, help="Airflow retry probe runs (their median is used)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories and the launches' logs")
    args = parser.parse_args()
    if args.repeats < 1 or args.probes < 1:
        raise SystemExit("--repeats and --probes: at least 1")
    if os.geteuid() != 0:
        raise SystemExit("needs root: network namespaces and sshd")
    work = tempfile.mkdtemp(prefix="bench-elastic-")
    os.environ["DTRAIN_HOME"] = os.path.join(work, "home")
    ways = {"elastic": elastic, "relaunch": relaunch}
    times: dict[str, list[float]] = {way: [] for way in ways}
    started = time.monotonic()
    probes = airflow_retry_overhead(work, args.probes)
    airflow = statistics.median(p["total"] for p in probes)
    parts = {k: statistics.median(p[k] for p in probes) for k in ("end", "between tries", "start-up")}
    net = NetCluster(HOSTS).start()
    try:
        cluster = start_cluster(os.path.join(work, "sshd"), net=net)
        try:
            for i in range(args.repeats):
                order = list(ways) if i % 2 == 0 else list(reversed(ways))
                notes = {}
                for way in order:
                    os.makedirs(os.path.join(work, f"{way}-{i}"))
                    seconds, notes[way] = ways[way](cluster, net, os.path.join(work, f"{way}-{i}", "run"))
                    times[way].append(seconds)
                    cluster.reboot(VICTIM)  # the crashed host back (its sshd), for the next run
                inproc = times["relaunch"][-1]
                print(f"  repetition {i + 1} ({' then '.join(order)}): elastic {times['elastic'][-1]:.1f} s "
                      f"({notes['elastic']}), relaunch by Airflow retry {inproc + airflow:.1f} s = in-process "
                      f"{inproc:.1f} s ({notes['relaunch']}) + Airflow retry {airflow:.1f} s", flush=True)
        finally:
            cluster.stop()
    finally:
        net.stop()
        left = [f"pid {pid}" for pid in sorted(job_pids(work, below=True))]
        left += [thing for thing in leftovers() if f"{PREFIX}{net.tag}" in thing]
        if left:
            print(f"  left behind by the bench: {', '.join(left)}", flush=True)
    if args.keep:
        print(f"  run directories and logs kept in {work}")
    else:
        shutil.rmtree(work)  # kept when a run failed (SystemExit above), for a look at its run directory and log
    e, r = statistics.median(times["elastic"]), statistics.median(times["relaunch"])
    delay = RETRY_DELAY.total_seconds()
    print(f"elastic: node loss costs {e:.1f} s (elastic continuation) vs {r + airflow:.1f} s (relaunch from "
          f"checkpoint by an Airflow retry: in-process {r:.1f} s + Airflow retry {airflow:.1f} s, of which "
          f"retry_delay {delay:g} s), ratio {e / (r + airflow):.2f} (goal <= 0.5; without the retry_delay "
          f"{e / (r + airflow - delay):.2f}; vs the in-process relaunch alone {e / r:.2f}); median of "
          f"{args.repeats}, 3 ssh hosts x 1 proc, host 2 crashed at step {FAULT_STEP} (checkpoint every {EVERY}, "
          f"{STEP_SLEEP:g} s steps), fault to rank 0 past its step; Airflow retry: median of {args.probes} probes "
          f"(end {parts['end']:.2f} + between tries {parts['between tries']:.2f} + start-up "
          f"{parts['start-up']:.2f} s), the pipeline factory's retry_delay, LocalExecutor on SQLite; "
          f"bench {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
