"""Benchmark: a node lost mid-training, this checkout against a reference commit, on the namespace cluster.

For each fault (partition: the host's link down; freeze: every process of the host stopped; crash:
every process of the host killed), a 2-host x 1-rank DDP job over the ssh backend (``dtrain launch``,
as a user runs it; ``tests/launch/backends/scripts/ddp_train.py --steps 2 --hang``: two real all-reduces across the
hosts, then the ranks run on) loses host 1, and the bench measures from the fault:

* **detected**: until ``dtrain launch`` ends with its verdict (its exit status and last line kept);
* **every rank gone**: until no process of the job is left on any host (the lost one included:
  a partitioned host stays cut off for the whole measurement; a frozen one thaws at the verdict);

for this checkout and for ``--previous`` (a git revision, checked out in a temporary worktree; its
launcher and its remote side both run, each on a cluster of its own). Default settings on both, and
``GLOO_SOCKET_IFNAME=eth0`` (every host's link on the namespace cluster), which the reference commits need
on such hosts.
Measurements stop at ``--cap`` seconds ("> cap": still not detected / still running then).

Prints one line per fault and checkout (``[checkout]``, ``[reference REV]``), then one line per fault with both and
their ratio. Needs root
(namespaces, sshd) and a clean clone with history for --previous.

    .venv/bin/python bench/faults.py [--faults partition,freeze,crash] [--modes attached,durable,slurm,mpi] [--previous 2a122e2] [--cap 150] [--resume]
    .venv/bin/python bench/faults.py --stragglers [--faults slow-cpu,slow-link] [--modes attached,durable,slurm,mpi] [--cap 60]

Modes: ``attached`` (``dtrain launch``: an ssh session per host holds the job) and ``durable`` (the
operator's default: a detached daemon per host, followed by polling, as Launcher.submit_detached +
attach; deferred mode's trigger decides with the same poll).

``--resume``: the time until training resumes instead, in each of ``--modes``. The package's reference
script (checkpoint every 5 steps) on both hosts; host 1 is faulted after step 7; at the verdict the host
comes back (the link healed, the host thawed, or its sshd or slurmd started again after the crash, as a
reboot) and the same launch runs again at once, as an Airflow retry with ``retry_delay=0`` would:
measured from the fault until the retry's rank 0 logs its first step, with the step it resumed from.
For Slurm that includes the wait for the lost node to be allocatable again.

``--stragglers``: a slow host instead of a lost one, in each of ``--modes``. A DDP job that trains until stopped
(``tests/launch/engine/faults/scripts/straggler_train.py``: an MLP on a fixed batch, gradients all-reduced, the
training helper's metrics) on both hosts; once both ranks logged 200 steps host 1 gets a quarter of a CPU
(``slow-cpu``: cgroup cfs quota) or a rate-limited link (``slow-link``: tc tbf, 40 mbit, and 4x the
batch, so that the healthy job is not bound by its all-reduce already); measured from then until the launcher's log names a straggler (``[straggler] ...``: the node for a
slow CPU, the network for a slow link), capped at ``--cap``; then the job is stopped and its end-of-job
stall report kept. Whether any line ever blamed node 0 (healthy) is printed too.

``slurm`` mode: ``dtrain launch --backend slurm`` on a Slurm cluster of the same two hosts (a slurmd on
each, slurmctld here; its SlurmdTimeout is 60 s, Slurm's default 300 s), default settings; compare it with
``--previous 533a83a``, the last commit before the Slurm nodes' leases (2a122e2's Slurm backend ran on
127.0.0.1 only).

"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dtrain.launch.node.proctree import environ_of  # noqa: E402
from tests.netcluster import NetCluster  # noqa: E402
from tests.sshd_cluster import start_cluster  # noqa: E402

SCRIPT = os.path.join(REPO, "tests", "launch", "backends", "scripts", "ddp_train.py")
FAULTS = ("partition", "freeze", "crash")
#: attached: ``dtrain launch`` (an ssh session per host holds the job); durable: the operator's default mode,
#: a detached job (a daemon per host) that the launcher follows by polling (:data:`DURABLE`); slurm:
#: ``dtrain launch --backend slurm`` on a Slurm cluster of the same hosts; mpi: ``dtrain launch --backend ssh
#: --distribution mpi`` (mpirun over ssh, an orted per host)
MODES = ("attached", "durable", "slurm", "mpi")
#: the durable mode's launcher, as the operator runs it (submit detached, then follow), for either checkout
DURABLE = """
import json, sys
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
launcher = Launcher(LaunchSpec(**json.loads(sys.argv[1])), sink=lambda line: print(line, flush=True))
result = launcher.attach(launcher.submit_detached())
print(f"[bench] exit {result.exit_code}: {(getattr(result, 'lost', None) or {}).get('message', '')}", flush=True)
sys.exit(min(result.exit_code, 255))
"""
#: the default reference: the last commit before the nodes' leases and the lost-node probes
PREVIOUS = "2a122e2"
#: --resume: the package's reference script, checkpointing every EVERY steps, 0.2 s a step (long enough
#: to outlast the measurement; the bench stops it); host 1 is faulted once rank 0 logged FAULT_AFTER
EVERY = 5
FAULT_AFTER = 7
RESUME_JOB = [sys.executable, "-m", "dtrain.training.reference.train_digits", "--epochs", "50",
              "--checkpoint-every", str(EVERY), "--step-sleep", "0.2"]


def job_pids(run_dir: str, below: bool = False) -> set[int]:
    """Every live process of the job on any host: its environment names the run directory (``below``:
    or any run directory under it, for every job of a bench)."""
    found = set()
    for name in os.listdir("/proc"):
        named = (environ_of(int(name)) or {}).get("DTRAIN_RUN_DIR", "") if name.isdigit() else ""
        if named == run_dir or (below and named.startswith(run_dir + os.sep)):
            try:
                with open(f"/proc/{name}/stat", encoding="utf-8") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                        found.add(int(name))
            except OSError:
                continue
    return found


def inject(net: NetCluster, fault: str) -> None:
    {"partition": net.partition, "freeze": net.freeze, "crash": net.crash}[fault](1)


def measure(fault: str, mode: str, code_dir: str, work: str, cap: float) -> dict:
    """One lost node on a fresh 2-host cluster whose hosts and launcher run the code in ``code_dir``."""
    run_dir = os.path.join(work, "run")
    env, net, cluster, argv = start_mode(mode, code_dir, work, run_dir, [sys.executable, SCRIPT, "--steps", "2", "--hang"])
    log = open(os.path.join(work, "launch.log"), "w+b")
    cli = start_launch(argv, code_dir, env, log)
    try:
        deadline = time.monotonic() + 180
        reports = os.path.join(run_dir, "reports")
        while not (os.path.isdir(reports) and len(os.listdir(reports)) == 2):
            if cli.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{fault}: the job did not start (exit {cli.poll()}); see {log.name}")
            time.sleep(0.2)
        t0 = time.monotonic()
        inject(net, fault)
        detected = gone = None
        while time.monotonic() - t0 < cap and gone is None:
            now = time.monotonic() - t0
            if detected is None and cli.poll() is not None:
                detected = now
                if fault == "freeze":  # the host comes back: does anything of the old job stay?
                    net.thaw(1)
            if detected is not None and not job_pids(run_dir):
                gone = now
            time.sleep(0.2)
        log.seek(0)
        lines = [line for line in log.read().decode(errors="replace").splitlines() if "lost" in line or "exit" in line]
        return {"detected": detected, "gone": gone, "exit": cli.poll(), "verdict": (lines or [""])[-1].strip()}
    finally:
        stop_launch(cli)
        stop_hosts(net, cluster, run_dir)
        log.close()


def start_mode(mode: str, code_dir: str, work: str, run_dir: str, command: list[str]):
    """A fresh 2-host cluster for ``mode`` whose hosts and launcher run the code in ``code_dir``, and the
    launcher's argv for ``command`` on it (one rank a host, default settings): (env, net, cluster, argv)."""
    if mode == "slurm":
        env, net, slurm = start_slurm(code_dir, work)
        return env, net, slurm, slurm_argv(run_dir, command)
    env, net, ssh = start_hosts(code_dir, work)
    if mode in ("attached", "mpi"):
        return env, net, ssh, attached_argv(ssh, run_dir, command, mpi=mode == "mpi")
    spec = {"command": command, "nodes": 2, "procs_per_node": 1,
            "backend": "ssh", "device": "cpu", "run_dir": run_dir, "env": {"GLOO_SOCKET_IFNAME": "eth0"},
            "backend_options": {"hostfile": ssh.hostfile(1), "key_file": ssh.key_file,  # default settings
                                "known_hosts_file": ssh.known_hosts, "strict_host_key_checking": "yes"}}
    return env, net, ssh, [sys.executable, "-c", DURABLE, json.dumps(spec)]


def start_slurm(code_dir: str, work: str):
    """A fresh 2-host Slurm cluster (namespaces, a slurmd each, slurmctld here; tests/slurm_cluster.py, whose
    SlurmdTimeout is 60 s: Slurm's default is 300 s); the jobs get the launcher's environment (sbatch's
    --export=ALL), so they run the code in ``code_dir`` too. Returns that environment, the network and the cluster."""
    from tests.slurm_cluster import SlurmCluster

    net = NetCluster(2, decoy=False).start()  # every host's link is eth0: the reference commits' workaround works
    try:
        slurm = SlurmCluster(os.path.join(work, "slurm"), net=net).start()
    except BaseException:
        net.stop()
        raise
    env = dict(os.environ, PYTHONPATH=os.path.join(code_dir, "operators"), DTRAIN_HOME=os.path.join(work, "home"),
               **slurm.env)
    return env, net, slurm


def slurm_argv(run_dir: str, command: list[str]) -> list[str]:
    """``dtrain launch --backend slurm`` of ``command``, one rank on each of the 2 nodes, default settings."""
    return [sys.executable, "-m", "dtrain.cli", "launch", "--backend", "slurm", "--nodes", "2", "--procs-per-node", "1",
            "--device", "cpu", "--run-dir", run_dir, "--env", "GLOO_SOCKET_IFNAME=eth0", "--", *command]


def start_hosts(code_dir: str, work: str):
    """A fresh 2-host cluster (namespaces, an sshd each) whose sessions run the code in ``code_dir``;
    returns the launcher's environment, the network and the ssh cluster."""
    env = dict(os.environ, PYTHONPATH=os.path.join(code_dir, "operators"), DTRAIN_HOME=os.path.join(work, "home"))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # the hosts' sshd hands it to their sessions
    net = NetCluster(2, decoy=False).start()  # every host's link is eth0: the reference commits' workaround works
    try:
        ssh = start_cluster(os.path.join(work, "sshd"), net=net)
    except BaseException:
        net.stop()
        raise
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
    return env, net, ssh


def stop_hosts(net: NetCluster, cluster, run_dir: str) -> None:
    """Undo any fault of host 1, stop the cluster (its sshds or its Slurm), and kill what is left of the job."""
    net.thaw(1)
    net.heal(1)
    cluster.stop()
    net.stop()
    for pid in job_pids(run_dir):  # a reference commit may leave ranks behind: not the next run's problem
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def start_launch(argv: list[str], code_dir: str, env: dict[str, str], log) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=code_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def stop_launch(cli: subprocess.Popen) -> None:
    """SIGTERM (the launcher then stops its ranks on every host), SIGKILL after 30 s."""
    if cli.poll() is None:
        cli.terminate()
        try:
            cli.wait(timeout=30)
        except subprocess.TimeoutExpired:
            cli.kill()


def attached_argv(ssh, run_dir: str, command: list[str], mpi: bool = False) -> list[str]:
    """``dtrain launch`` of ``command`` on both hosts, one rank each, default settings (``mpi``: by mpirun)."""
    return [sys.executable, "-m", "dtrain.cli", "launch", "--backend", "ssh", "--hostfile", ssh.hostfile(1),
            *(["--distribution", "mpi"] if mpi else []),
            "--nodes", "2", "--procs-per-node", "1", "--device", "cpu", "--run-dir", run_dir,
            "--ssh-key", ssh.key_file, "--ssh-known-hosts", ssh.known_hosts, "--ssh-strict-host-key-checking", "yes",
            # the reference commits need it on hosts of their own (this checkout finds it itself): the same job for both
            "--env", "GLOO_SOCKET_IFNAME=eth0", "--", *command]


def rank_steps(run_dir: str, rank: int = 0) -> list[int]:
    """The steps a rank logged, in order (a retry that resumed logs the steps after its checkpoint again)."""
    try:
        with open(os.path.join(run_dir, "metrics", f"rank{rank}.jsonl"), encoding="utf-8") as fh:
            return [json.loads(line)["step"] for line in fh if line.endswith("\n")]
    except FileNotFoundError:
        return []


def bring_back(net: NetCluster, cluster, fault: str) -> None:
    """The lost host is back at the verdict: the link healed, the host thawed, or rebooted (its sshd or
    slurmd again)."""
    if fault == "partition":
        net.heal(1)
    elif fault == "freeze":
        net.thaw(1)
    else:
        cluster.reboot(1)


def measure_resume(fault: str, mode: str, code_dir: str, work: str, cap: float) -> dict:
    """Fault host 1 of a checkpointing job (``RESUME_JOB``) after its checkpoint at step ``EVERY``, bring the
    host back at the verdict and relaunch the same command at once (an Airflow retry with no delay):
    the time from the fault until the retry logs its first step, and the step it resumed from."""
    run_dir = os.path.join(work, "run")
    env, net, cluster, argv = start_mode(mode, code_dir, work, run_dir, RESUME_JOB)
    launches: list[subprocess.Popen] = []
    logs = [open(os.path.join(work, f"launch{i}.log"), "w+b") for i in (1, 2)]

    def launch(log) -> subprocess.Popen:
        launches.append(start_launch(argv, code_dir, env, log))
        return launches[-1]

    found = {"detected": None, "resumed": None, "from_step": None, "exit": None}
    try:
        first = launch(logs[0])
        deadline = time.monotonic() + 240
        while max(rank_steps(run_dir), default=0) < FAULT_AFTER:
            if first.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{fault}: the job did not reach step {FAULT_AFTER} (exit {first.poll()}); see {logs[0].name}")
            time.sleep(0.1)
        t0 = time.monotonic()
        inject(net, fault)
        while first.poll() is None and time.monotonic() - t0 < cap:
            time.sleep(0.2)
        if first.poll() is None:
            return found
        found["detected"], found["exit"] = time.monotonic() - t0, first.poll()
        bring_back(net, cluster, fault)
        logged = len(rank_steps(run_dir))
        retry = launch(logs[1])
        while time.monotonic() - t0 < cap and retry.poll() is None:
            steps = rank_steps(run_dir)
            if len(steps) > logged:
                found["resumed"], found["from_step"] = time.monotonic() - t0, steps[logged] - 1
                break
            time.sleep(0.1)
        return found
    finally:
        for cli in launches:
            stop_launch(cli)
        stop_hosts(net, cluster, run_dir)
        for log in logs:
            log.close()


#: --stragglers: each slow fault, what it does to host 1, the script's arguments, and the live verdict looked for
STRAGGLERS = {
    "slow-cpu": (lambda net: net.slow_cpu(1, 0.25), [], "[straggler] LoadBalancing: TRIGGERED on rank 1 (node 1)"),
    "slow-link": (lambda net: net.slow_link(1, 40), ["--batch", "1024"], "[straggler] CommunicationBound: TRIGGERED"),
}
STRAGGLER_SCRIPT = os.path.join(REPO, "tests", "launch", "engine", "faults", "scripts", "straggler_train.py")
#: steps both ranks train healthy before host 1 slows: more than the live look's 50, so a verdict must come
#: from the steps after the slowdown
HEALTHY_STEPS = 200


def log_lines(log) -> list[str]:
    log.seek(0)
    return log.read().decode(errors="replace").splitlines()


def measure_straggler(fault: str, mode: str, code_dir: str, work: str, cap: float) -> dict:
    """Slow host 1 of a running DDP job; the time until the launcher names the straggler (or the network)."""
    slow, script_args, verdict = STRAGGLERS[fault]
    run_dir = os.path.join(work, "run")
    env, net, cluster, argv = start_mode(mode, code_dir, work, run_dir, [sys.executable, STRAGGLER_SCRIPT, *script_args])
    log = open(os.path.join(work, "launch.log"), "w+b")
    cli = start_launch(argv, code_dir, env, log)
    found = {"named": None, "blamed_node0": False, "report": ""}
    try:
        deadline = time.monotonic() + 180
        while min(len(rank_steps(run_dir, rank)) for rank in (0, 1)) < HEALTHY_STEPS:
            if cli.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{fault}: the job did not start (exit {cli.poll()}); see {log.name}")
            time.sleep(0.2)
        t0 = time.monotonic()
        slow(net)
        while time.monotonic() - t0 < cap and cli.poll() is None:
            if any(line.startswith(verdict) for line in log_lines(log)):
                found["named"] = time.monotonic() - t0
                break
            time.sleep(0.2)
        net.full_cpu(1)  # a throttled host stops slowly
        net.fast_link(1)
        stop_launch(cli)
        lines = log_lines(log)
        found["blamed_node0"] = any("TRIGGERED" in line and "node 0" in line for line in lines)
        rule = "[stall] LoadBalancing: " if fault == "slow-cpu" else "[stall] CommunicationBound: "
        found["report"] = next((line for line in reversed(lines) if line.startswith(rule)),
                               "no " + rule.split()[1].rstrip(":") + " rule in its report")
        return found
    finally:
        stop_launch(cli)
        stop_hosts(net, cluster, run_dir)
        log.close()


def straggler_row(mode: str, fault: str, release: str, found: dict, cap: float) -> str:
    return (f"faults {backend_of(mode)} {fault} [{release}]: named {seconds(found['named'], cap)} after the slowdown; "
            f"healthy node 0 blamed: {'yes' if found['blamed_node0'] else 'no'}; its report at the end: {found['report']}")


def straggler_both(mode: str, fault: str, new: dict, old: dict, cap: float) -> str:
    return (f"faults {backend_of(mode)} {fault}: named while running {seconds(new['named'], cap)} vs reference "
            f"{seconds(old['named'], cap)} = {ratio(new['named'], old['named'], cap)}; healthy node blamed: "
            f"{'yes' if new['blamed_node0'] else 'no'} vs {'yes' if old['blamed_node0'] else 'no'}")


def backend_of(mode: str) -> str:
    return mode if mode == "slurm" else f"ssh {mode}"


def worktree(rev: str, where: str) -> str:
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", where, rev], check=True, capture_output=True)
    return where


def seconds(value: float | None, cap: float) -> str:
    return f"> {cap:g} s" if value is None else f"{value:.1f} s"


def ratio(new: float | None, old: float | None, cap: float) -> str:
    if new is None:
        return "n/a"
    return f"{new / (old if old is not None else cap):.2f}x" + ("" if old is not None else " (at most)")


def resume_row(mode: str, fault: str, release: str, found: dict, cap: float) -> str:
    return (f"faults {backend_of(mode)} resume {fault} [{release}]: detected {seconds(found['detected'], cap)}, "
            f"training resumed {seconds(found['resumed'], cap)} after the fault (from step "
            f"{found['from_step']}); first launch exit {found['exit']}")


def resume_both(mode: str, fault: str, new: dict, old: dict, cap: float) -> str:
    return (f"faults {backend_of(mode)} resume {fault}: training resumed {seconds(new['resumed'], cap)} vs reference "
            f"{seconds(old['resumed'], cap)} = {ratio(new['resumed'], old['resumed'], cap)} "
            f"[checkpoint every {EVERY} steps, host back at the verdict, retry at once]")


def compare(faults: list[str], releases: dict[str, str], work: str, cap: float, measure, row, both) -> None:
    """``measure(fault, code_dir=, work=, cap=)`` each fault on each checkout (``releases``: the checkout first, then
    the reference); a ``row`` per run, then ``both`` per fault."""
    results = {}
    for fault in faults:
        for release, code in releases.items():
            found = results[fault, release] = measure(fault, code_dir=code, work=tempfile.mkdtemp(dir=work), cap=cap)
            print(row(fault, release, found, cap), flush=True)
    for fault in faults:
        print(both(fault, *(results[fault, release] for release in releases), cap))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--previous", default=PREVIOUS, help="the git revision to compare with")
    p.add_argument("--modes", default="attached,durable", help=f"a list of {', '.join(MODES)}")
    p.add_argument("--cap", type=float, default=150.0)
    p.add_argument("--resume", action="store_true",
                   help="measure the time until training resumes (one immediate retry) instead")
    p.add_argument("--stragglers", action="store_true",
                   help=f"slow host 1 instead ({', '.join(STRAGGLERS)}): the time until the straggler is named")
    args = p.parse_args()
    if args.stragglers:
        args.faults = ",".join(STRAGGLERS) if args.faults == ",".join(FAULTS) else args.faults
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes: {args.modes!r} is not a list of {', '.join(MODES)}")
    faults = [f for f in args.faults.split(",") if f]
    allowed = STRAGGLERS if args.stragglers else FAULTS
    unknown = sorted(set(faults) - set(allowed))
    if unknown:
        p.error(f"--faults: {unknown[0]!r} is not one of {', '.join(allowed)}")
    work = tempfile.mkdtemp(prefix="dtrain-bench-faults-")
    previous = None
    try:
        previous = worktree(args.previous, os.path.join(work, "previous"))
        releases = {"checkout": REPO, f"reference {args.previous}": previous}
        if args.resume or args.stragglers:
            measure_one, row, both = ((measure_resume, resume_row, resume_both) if args.resume
                                      else (measure_straggler, straggler_row, straggler_both))
            for mode in modes:
                compare(faults, releases, work, args.cap, functools.partial(measure_one, mode=mode),
                        functools.partial(row, mode), functools.partial(both, mode))
            return 0
        results: dict[tuple[str, str, str], dict] = {}
        for mode in modes:
            for fault in faults:
                for release, code in releases.items():
                    found = measure(fault, mode, code, tempfile.mkdtemp(dir=work), args.cap)
                    results[mode, fault, release] = found
                    print(f"faults {backend_of(mode)} {fault} [{release}]: detected {seconds(found['detected'], args.cap)}, "
                          f"every rank gone {seconds(found['gone'], args.cap)}; exit {found['exit']}: {found['verdict']}",
                          flush=True)
        for mode in modes:
            for fault in faults:
                new, old = (results[mode, fault, release] for release in releases)
                print(f"faults {backend_of(mode)} {fault}: detected {seconds(new['detected'], args.cap)} vs reference "
                      f"{seconds(old['detected'], args.cap)} = {ratio(new['detected'], old['detected'], args.cap)}; "
                      f"every rank gone {seconds(new['gone'], args.cap)} vs reference {seconds(old['gone'], args.cap)} "
                      f"= {ratio(new['gone'], old['gone'], args.cap)}")
    finally:
        if previous is not None:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", previous], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
