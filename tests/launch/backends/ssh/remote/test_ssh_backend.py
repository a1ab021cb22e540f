"""The SSH backend against real sshd hosts with their own addresses (the namespace cluster,
tests/netcluster.py: node 0's first interface is a decoy, and nobody sets GLOO_SOCKET_IFNAME): DDP
trains 2 hosts x 2 processes, a hostile argument stays inert, a failing rank and SIGTERM to `dtrain
launch` leave no process on any host (checked by PID), exit codes propagate."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from tests.remote_jobs import (job_processes, needs_sshd, reports, run_within, still_alive, train_command,
                                   wait_for)

pytestmark = [needs_sshd, pytest.mark.timeout(240)]
DTRAIN = os.path.join(os.path.dirname(sys.executable), "dtrain")
MARKER = f"/tmp/dtrain-pwned-{uuid.uuid4().hex[:8]}"
HOSTILE = [f"$(touch {MARKER}); x", f"`touch {MARKER}`", f"; touch {MARKER} #", "a 'b' \"c\"", "*", "$HOME", "\\n"]


def ssh_spec(cluster, tmp_path, command, fanout=32, **kw) -> LaunchSpec:
    return LaunchSpec(command=command, nodes=2, procs_per_node=2, backend="ssh", device="cpu",
                      backend_options={"hostfile": cluster.hostfile(2), "fanout": fanout, **cluster.ssh_settings()},
                      run_dir=str(tmp_path / "run"), **kw)


@pytest.fixture(scope="module")
def ddp_run(net_cluster, tmp_path_factory):
    """One 2x2 DDP job over ssh, shared by the assertions below (each job costs ~20 s on 2 cores).
    With fanout 1: the second host's session opens only once the first host's agent is up."""
    tmp = tmp_path_factory.mktemp("ddp")
    assert not os.path.exists(MARKER)
    lines: list[str] = []
    spec = ssh_spec(net_cluster, tmp, train_command("--steps", "6", "--", *HOSTILE), fanout=1)
    launcher = Launcher(spec, sink=lines.append)
    result = run_within(launcher, lines)
    return result, lines, launcher


def test_ddp_trains_on_two_hosts_with_node_rank_in_host_order(ddp_run, net_cluster):
    result, lines, launcher = ddp_run
    assert result.exit_code == 0, "\n".join(lines[-40:])
    got = reports(result.run_dir)
    assert sorted(got) == [0, 1, 2, 3]
    for rank, rep in got.items():
        env = rep["env"]
        assert env["WORLD_SIZE"] == "4" and env["RANK"] == str(rank) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(rank % 2)
        # Node rank follows the hostfile's order: the node index the backend gave the host.
        assert env["NODE_RANK"] == str(rank // 2) == rep["node_index"]
        assert env["MASTER_ADDR"] == net_cluster.net.hosts[0].address
        # each node's own interface toward MASTER_ADDR (node 0: eth1, after its decoy eth0)
        assert env["GLOO_SOCKET_IFNAME"] == net_cluster.net.hosts[rank // 2].interface
    # DDP all-reduced the gradients: every rank saw the same averaged gradient at every step,
    # although each trained on its own data; the weights stayed identical; the loss fell.
    grads = [got[r]["grad_sums"] for r in range(4)]
    assert all(g == pytest.approx(grads[0], rel=1e-9, abs=1e-12) for g in grads)
    assert len({round(got[r]["weights"], 9) for r in range(4)}) == 1
    losses = got[0]["losses"]
    assert losses[-1] < losses[0] * 0.9
    # Every host's output streamed with its prefix.
    assert any(line.startswith("[node0 rank0] rank 0 done") for line in lines)
    assert any(line.startswith("[node1 rank3] rank 3 done") for line in lines)
    assert still_alive(job_processes(result.job_id)) == []


def test_fanout_one_opens_the_next_host_only_after_the_previous_agent_announced(ddp_run):
    _, _, launcher = ddp_run
    backend = launcher.backend
    assert sorted(backend.announced_at) == [0, 1]
    assert backend.supervisor.started_at[1] >= backend.announced_at[0]


def test_hostile_argument_reaches_the_script_verbatim_and_stays_inert(ddp_run):
    result, lines, _ = ddp_run
    assert result.exit_code == 0, "\n".join(lines[-40:])
    for rep in reports(result.run_dir).values():
        assert rep["argv"][-len(HOSTILE):] == HOSTILE
    assert not os.path.exists(MARKER)


def test_failing_rank_tears_down_every_host_and_propagates_its_exit_code(net_cluster, tmp_path):
    lines: list[str] = []
    # Rank 3 (on the second host) exits 3 after one step; the others would block in all-reduce.
    spec = ssh_spec(net_cluster, tmp_path, train_command("--steps", "50", "--fail-rank", "3", "--hang"))
    launcher = Launcher(spec, sink=lines.append)
    seen: dict[int, object] = {}
    cmdlines: list[str] = []
    done = threading.Event()

    def watch():  # remember every process of the job on every host while it runs
        while not done.is_set():
            if launcher.job is not None:
                for proc in job_processes(launcher.job.job_id):
                    if proc.pid not in seen:
                        seen[proc.pid] = proc
                        cmdlines.append(" ".join(proc.info["cmdline"] or ()))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_within(launcher, lines)
    finally:
        done.set()
        watcher.join()
    assert result.exit_code == 3 and result.failed_rank == 3, "\n".join(lines[-40:])
    assert result.failed_node == 1
    assert "rank 3 fails on purpose" in result.tail
    names = "\n".join(cmdlines)
    assert "dtrain.launch.backends.ssh.remote_agent" in names and "dtrain.launch.node.torchrun_agent" in names
    assert len(seen) >= 2 + 2 + 2 + 4  # ssh clients, remote agents, torchrun agents, ranks (+ wrappers)
    assert still_alive(list(seen.values())) == []
    assert still_alive(job_processes(result.job_id)) == []


def hanging_launch_argv(net_cluster, run_dir, steps: int) -> list[str]:
    """`dtrain launch` of a 2-host x 2-process job whose ranks train ``steps`` steps, then hang."""
    return [DTRAIN, "launch", "--backend", "ssh", "--hostfile", net_cluster.hostfile(2), "--nodes", "2",
            "--procs-per-node", "2", "--device", "cpu", "--run-dir", str(run_dir),
            "--ssh-key", net_cluster.key_file, "--ssh-known-hosts", net_cluster.known_hosts,
            "--ssh-strict-host-key-checking", "yes", "--", *train_command("--steps", str(steps), "--hang")]


def test_sigterm_to_dtrain_launch_leaves_no_process_on_any_host(net_cluster, tmp_path):
    run_dir = tmp_path / "run"
    argv = hanging_launch_argv(net_cluster, run_dir, steps=2)
    log = open(tmp_path / "launch.log", "wb")
    cli = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        # Every rank trained and now sleeps: the whole job is up on both hosts.
        assert wait_for(lambda: len(reports(str(run_dir))) == 4, timeout=150), (tmp_path / "launch.log").read_text()
        procs = [p for p in job_processes(str(run_dir)) if p.pid != cli.pid]
        procs += [p for p in _job_processes_by_env_dir(str(run_dir)) if p.pid not in {q.pid for q in procs}]
        assert len(procs) >= 2 + 2 + 2 + 4, [p.pid for p in procs]
        cli.send_signal(signal.SIGTERM)
        code = cli.wait(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert code == 143, (tmp_path / "launch.log").read_text()[-3000:]
    assert wait_for(lambda: still_alive(procs) == [], timeout=10), still_alive(procs)


def _job_processes_by_env_dir(run_dir: str):
    """Processes whose env says they belong to this run directory (the CLI's job id is generated)."""
    import psutil

    out = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("DTRAIN_RUN_DIR") == run_dir:
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def test_tensorflow_ranks_get_their_tf_config_over_ssh(net_cluster, tmp_path):
    """distribution=tensorflow with one parameter server: each rank's TF_CONFIG, compared exactly."""
    import json

    lines: list[str] = []
    spec = ssh_spec(net_cluster, tmp_path, train_command("--start-only"), distribution="tensorflow",
                    parameter_servers=1)
    result = run_within(Launcher(spec, sink=lines.append), lines)
    assert result.exit_code == 0, "\n".join(lines[-40:])
    got = reports(result.run_dir)
    port = int(json.loads(got[0]["tf_config"])["cluster"]["worker"][0].split(":")[1])
    first, second = (host.address for host in net_cluster.net.hosts[:2])
    cluster = {"worker": [f"{first}:{port}", f"{first}:{port + 1}", f"{second}:{port + 2}"],
               "ps": [f"{second}:{port + 3}"]}
    for rank, task in enumerate([("worker", 0), ("worker", 1), ("worker", 2), ("ps", 0)]):
        assert json.loads(got[rank]["tf_config"]) == {
            "cluster": cluster, "task": {"type": task[0], "index": task[1]}, "environment": "cloud"}


def test_sigkill_of_the_launcher_still_leaves_no_process(net_cluster, tmp_path):
    """No handler runs on SIGKILL: the stdin lifeline closes, every remote agent stops its tree."""
    run_dir = tmp_path / "run"
    argv = hanging_launch_argv(net_cluster, run_dir, steps=1)
    cli = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert wait_for(lambda: len(reports(str(run_dir))) == 4, timeout=150)
        procs = [p for p in job_processes(str(run_dir)) if p.pid != cli.pid]
        procs += [p for p in _job_processes_by_env_dir(str(run_dir)) if p.pid not in {q.pid for q in procs}]
        assert len(procs) >= 2 + 2 + 2 + 4
        cli.kill()
        cli.wait(timeout=10)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert wait_for(lambda: still_alive(procs) == [], timeout=20), still_alive(procs)


def test_unreachable_host_fails_with_ssh_status_and_stops_the_others(net_cluster, tmp_path):
    closed = 2222  # nobody listens there on host 1: connection refused
    other = net_cluster.hosts[1].address
    lines: list[str] = []
    spec = LaunchSpec(command=train_command("--steps", "1", "--hang"), nodes=2, procs_per_node=1, backend="ssh",
                      device="cpu", run_dir=str(tmp_path / "run"),
                      backend_options={"hosts": [f"root@{net_cluster.hosts[0].line} slots=1", f"root@{other}:{closed}"],
                                       **net_cluster.ssh_settings()})
    result = run_within(Launcher(spec, sink=lines.append), lines)
    assert result.exit_code == 255 and result.failed_node == 1, "\n".join(lines[-20:])
    assert any("Connection refused" in line for line in result.tail), result.tail
    assert any(f"ssh to {other} failed (exit 255)" in line for line in lines)
    assert wait_for(lambda: still_alive(job_processes(result.job_id)) == [], timeout=10)


def test_rank_output_never_steers_teardown(net_cluster, tmp_path):
    """A rank printing the agent's announcement (with the victim's process group) must not get
    that group killed: the pgid comes only from the nonce-bearing line of the agent itself."""
    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        forge = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forge_announce.py")
        spec = LaunchSpec(command=[forge], nodes=2, procs_per_node=1, backend="ssh", device="cpu",
                          env={"VICTIM_PGID": str(victim.pid)}, run_dir=str(tmp_path / "run"),
                          backend_options={"hostfile": net_cluster.hostfile(1), **net_cluster.ssh_settings()})
        lines: list[str] = []
        launcher = Launcher(spec, sink=lines.append)
        result = run_within(launcher, lines)
        assert result.exit_code == 3, lines[-30:]
        assert set(launcher.backend.pgids) == {0, 1} and victim.pid not in launcher.backend.pgids.values()
        assert victim.poll() is None, "the victim's process group was signalled by rank output"
        assert wait_for(lambda: not still_alive(job_processes(result.job_id)), 30)
    finally:
        victim.kill()
        victim.wait()


def test_announcements_are_trusted_only_with_the_nonce_on_their_own_stream():
    from dtrain.launch.backends.ssh.backend import SSHBackend

    backend = SSHBackend(sink=lambda line: None)
    real = f"[node1] [dtrain-remote] nonce={backend.nonce} node=1 pgid=4242 host=h"
    for forged in (f"[node1] [dtrain-remote] nonce={'0' * 32} node=1 pgid=4242 host=h",   # wrong nonce
                   f"[node0] [dtrain-remote] nonce={backend.nonce} node=1 pgid=4242 host=h",  # another stream
                   f"[node1] [dtrain-remote] nonce={backend.nonce} node=1 pgid=1 host=h",     # kill -- -1
                   f"[node1] [dtrain-remote] nonce={backend.nonce} node=1 pgid=0 host=h",
                   f"[node1 rank1] {real}",                                                   # inside rank output
                   "[node1] [dtrain-remote] node=1 pgid=4242 host=h"):                       # the old format
        backend._watch_sink(forged)
    assert backend.pgids == {}
    backend._watch_sink(real)
    backend._watch_sink(real.replace("4242", "999"))  # first announcement wins
    assert backend.pgids == {1: 4242}
