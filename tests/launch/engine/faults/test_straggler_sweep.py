"""The stall report names a slow node whatever the slowdown's shape, and never a healthy one: jobs of the
reference digits script (dtrain.training.reference.train_digits, its collective timer) over the ssh backend
on hosts with their own addresses (tests/netcluster.py), host 1 made slow once every rank has taken its
first step (at a tenth of a CPU, importing torch alone took a rank a minute).

The sweep: a CPU quota on host 1 (cgroup cfs quota, which stops the host's ranks at arbitrary points,
inside their all-reduce too) of 10 %, 30 % and 60 % of one CPU, for its 1 or 2 ranks, in jobs of about 30
steps and of 200; a rate-limited link into host 1 (no straggler: the network sets the pace; the link
probe names the link into node 1); clean runs, which name nobody and no link. The live line: tests/launch/engine/faults/test_stragglers.py (host 1 slowed mid-run).

One cluster for every case (the suite's session ``net_cluster``); each job lasts seconds."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from dtrain.rundir import RunDir
from tests.remote_jobs import needs_sshd

pytestmark = [needs_sshd, pytest.mark.timeout(240)]

#: a wider model than the script's default, so that a step computes for longer than its all-reduce takes: a
#: host whose ranks hardly compute is not slowed by a quota (they sleep in the all-reduce most of a step)
DIGITS = [sys.executable, "-m", "dtrain.training.reference.train_digits", "--checkpoint-every", "100000",
          "--hidden", "512"]
#: (per-rank batch, epochs) giving 30 steps and 200 steps per rank, by ranks per host (2 hosts; the digits'
#: 1437 training samples). Four ranks take a step of 359 samples each (all of a rank's share: one step an
#: epoch): with 64, a rank computed a quarter of its step and slept in the all-reduce the rest, two of them
#: used about half a CPU, and a quota of 60 % did not slow their host (nor could any report tell it from a
#: healthy one)
SHORT = {1: ("128", "6"), 2: ("359", "30")}
LONG = {1: ("128", "40")}
#: two ranks that compute most of each step (tests/launch/engine/faults/scripts/straggler_train.py: a 3-layer MLP on a
#: batch of 1024, one thread): the digits' ranks compute a tenth of a step and use too little of a CPU
#: for a quota of 60 % shared by two to slow them
COMPUTE_BOUND = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts",
                                              "straggler_train.py"), "--batch", "1024", "--steps", "200"]
#: a host's cgroup weight against every other process here (each weighs the default, 1024)
DEDICATED_SHARES = 64 * 1024
DEFAULT_SHARES = 1024


def digits(procs: int, shape: dict[int, tuple[str, str]]) -> list[str]:
    batch, epochs = shape[procs]
    return [*DIGITS, "--batch-size", batch, "--epochs", epochs]


class SlowOnceTraining:
    """Gives host 1 ``amount`` of a CPU once every rank of the job in ``run_dir`` has logged a step (a thread;
    ``join`` ends it, also when the job never got that far)."""

    def __init__(self, net, amount: float, run_dir: str, ranks: int):
        self.net, self.amount, self.run_dir, self.ranks = net, amount, run_dir, ranks
        self.done = threading.Event()
        self.slowed = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _every_rank_stepped(self) -> bool:
        metrics = RunDir(self.run_dir).metrics() if os.path.isdir(self.run_dir) else {}
        return len(metrics) == self.ranks and all(metrics.values())

    def _run(self) -> None:
        while not self.done.wait(0.05):
            if self._every_rank_stepped():
                self.net.slow_cpu(1, self.amount)
                self.slowed = True
                return

    def join(self) -> None:
        self.done.set()
        self.thread.join(timeout=10)


def run_job(cluster, tmp_path, procs: int, shape: dict[int, tuple[str, str]] | None = None,
            command: list[str] | None = None, slow: float | None = None):
    """The digits job of ``shape``, or ``command``, on 2 hosts of ``procs`` ranks each; host 1 at ``slow``
    of a CPU from the first step on."""
    spec = LaunchSpec(command=command or digits(procs, shape), nodes=2, procs_per_node=procs,
                      backend="ssh", device="cpu", run_dir=str(tmp_path / "run"),
                      backend_options={"hostfile": cluster.hostfile(procs), **cluster.ssh_settings()})
    lines: list[str] = []
    slower = SlowOnceTraining(cluster.net, slow, spec.run_dir, 2 * procs) if slow else None
    try:
        result = Launcher(spec, sink=lines.append).run()
    finally:
        if slower:
            slower.join()
    assert result.exit_code == 0, "\n".join(lines[-30:])
    assert slower is None or slower.slowed, "the job ended before every rank had logged a step"
    return result, lines


@pytest.fixture
def hosts(net_cluster):
    """Hosts 0 and 1 of the cluster as dedicated machines: their processes first on the cores the cluster's
    hosts share with the rest of the suite (cgroup v1 ``cpu.shares``). Without it, under load, a healthy
    host's rank got less than 60 % of a CPU, as little as the slowed host's quota, and was no faster
    than it (the report then rightly named nobody). Restored at the end, with host 1's CPU and link."""
    net = net_cluster.net
    for index in (0, 1):
        net._cgroup_write("cpu", net.hosts[index], "cpu.shares", str(DEDICATED_SHARES))
    yield net_cluster
    for index in (0, 1):
        net._cgroup_write("cpu", net.hosts[index], "cpu.shares", str(DEFAULT_SHARES))
    net.full_cpu(1)
    net.fast_link(1)


#: Two ranks sharing 60 % of a CPU run the compute-bound script: with the digits, in one run of four, host
#: 1's two ranks computed no slower than host 0's (medians 23.6 and 31.3 ms against 28.9 and 28.2 ms): the
#: quota had not slowed that host, and no report could have named it.
@pytest.mark.parametrize("amount, procs, shape, command", [
    (0.1, 1, SHORT, None),  # 30 steps, host 1's one rank at a tenth of a CPU
    (0.1, 2, SHORT, None),  # 30 steps, host 1's two ranks sharing a tenth
    (0.3, 2, SHORT, None),  # the 2x2 job of about 30 steps whose report said "ok" at 1.47x and blamed the network
    (0.6, 1, LONG, None),   # 200 steps, host 1's one rank at 60 % of a CPU
    (0.6, 2, None, COMPUTE_BOUND),  # 200 steps, host 1's two compute-bound ranks sharing 60 % of a CPU
], ids=["cpu10-2x1-short", "cpu10-2x2-short", "cpu30-2x2-short", "cpu60-2x1-long", "cpu60-2x2-long"])
def test_a_host_with_a_cpu_quota_is_named_and_never_a_healthy_one(hosts, tmp_path, amount, procs, shape, command):
    result, lines = run_job(hosts, tmp_path, procs, shape, command, slow=amount)
    report = "\n".join(line for line in lines if line.startswith("[stall]"))
    rule = result.stall["rules"]["LoadBalancing"]
    assert (rule["triggered"], rule["nodes"]) == (True, [1]), report
    assert {r["node"] for r in result.stall["ranks"] if r["rank"] in rule["ranks"]} == {1}, report
    assert result.stall["flags"] == ["LoadBalancing"], report  # not the network
    verdict = next(line for line in lines if line.startswith("[stall] LoadBalancing"))
    assert verdict.startswith("[stall] LoadBalancing: TRIGGERED on rank") and "(node 1)" in verdict, report


def test_a_rate_limited_link_is_named_by_the_link_probe_and_no_node_is_a_straggler(hosts, tmp_path):
    """What host 1 receives limited to 20 mbit/s. Two hosts have one link between them, which both ranks'
    all-reduce crosses: neither is waited for, so no straggler is named; the link probe after training
    times what each node receives and names the link into node 1, never node 0's."""
    hosts.net.slow_link(1, 20)
    result, lines = run_job(hosts, tmp_path, 1, command=[*digits(1, SHORT), "--probe-links"])
    report = "\n".join(line for line in lines if line.startswith("[stall]"))
    rules = result.stall["rules"]
    assert (rules["LoadBalancing"]["triggered"], rules["LoadBalancing"]["nodes"]) == (False, []), report
    assert rules["CommunicationBound"]["triggered"] is True, report
    assert (rules["SlowLink"]["triggered"], rules["SlowLink"]["nodes"], rules["SlowLink"]["from_nodes"]) == (
        True, [1], [0]), report
    verdict = next(line for line in lines if line.startswith("[stall] SlowLink"))
    assert verdict.startswith("[stall] SlowLink: TRIGGERED on the link into node 1 (from node 0): "), report


@pytest.mark.parametrize("procs, shape", [(1, LONG), (2, {2: ("359", "100")})], ids=["2x1-long", "2x2-long"])
def test_a_clean_run_names_nobody(hosts, tmp_path, procs, shape):
    """Jobs of 100 steps or more: in a 2x1 job of 30 steps on the test cluster's two shared cores, healthy host 0
    once computed 1.8x host 1's time for the whole job and was named, and in a 2x2 job of 25 steps under a
    load of 7, host 0's two ranks computed twice as long as host 1's (they were slower: the report said what
    happened, but no host had been slowed). Over more steps a busy moment is a small share of the job."""
    result, lines = run_job(hosts, tmp_path, procs, command=[*digits(procs, shape), "--probe-links"])
    report = "\n".join(line for line in lines if line.startswith("[stall]"))
    assert result.stall["rules"]["LoadBalancing"]["triggered"] is False, report
    assert result.stall["rules"]["SlowLink"]["triggered"] is False, report
    assert len(result.stall["rules"]["SlowLink"]["links"]) == 2, report  # both nodes probed
    assert not any("TRIGGERED on" in line for line in lines), report

