"""Scale mechanics of the SSH backend against real sshd hosts on loopback: every ssh action
runs at most ``fanout`` clients at once; a start that fails on some hosts names them all and
stops the started ones; a deferred job is watched through the shared run directory, with ssh
(over a reused master connection) only for a node whose heartbeat is stale."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import sys
import time

import pytest

from dtrain.errors import LaunchError
from dtrain.launch.backends.ssh import control
from dtrain.launch.backends.ssh import detached as nodes
from dtrain.launch.backends.ssh.detached_node import paths, status_from_files
from dtrain.launch.backends.ssh.fanout import NOT_RUN, run_bounded, run_bounded_async
from dtrain.launch.backends.ssh.hostfile import SSHSettings, coerce_hosts, ssh_argv
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from dtrain.launch.node.records import JobKey
from tests.remote_jobs import job_processes, needs_sshd, still_alive, wait_for

pytestmark = [needs_sshd, pytest.mark.timeout(120)]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def timed_commands(cluster, tmp_path, count: int) -> tuple[list[list[str]], list[str]]:
    """``count`` ssh commands alternating over the hosts; each records when it ran on its host."""
    settings = SSHSettings.from_mapping(cluster.ssh_settings())
    hosts = coerce_hosts([f"root@{h.line}" for h in cluster.hosts])
    argvs, files = [], []
    for i in range(count):
        out = str(tmp_path / f"cmd{i}")
        script = f"date +%s.%N > {shlex.quote(out)}.start; sleep 0.6; date +%s.%N > {shlex.quote(out)}.end"
        argvs.append(ssh_argv(settings, hosts[i % len(hosts)], shlex.join(["sh", "-c", script])))
        files.append(out)
    return argvs, files


def intervals(files: list[str]) -> list[tuple[float, float]]:
    def read(path):
        with open(path, encoding="utf-8") as fh:
            return float(fh.read())
    return [(read(f + ".start"), read(f + ".end")) for f in files]


@pytest.mark.parametrize("mode", ["threads", "asyncio"])
def test_fanout_never_runs_more_ssh_sessions_at_once_than_the_bound(ssh_cluster, tmp_path, mode):
    argvs, files = timed_commands(ssh_cluster, tmp_path, 6)
    if mode == "threads":
        results = run_bounded(argvs, limit=2, timeout=30)
    else:
        results = asyncio.run(run_bounded_async(argvs, limit=2, timeout=30))
    assert [r[0] for r in results] == [0] * 6, results
    # Two at once, never three: the bound held and was used.
    assert max_overlap(intervals(files)) == 2


def test_after_a_failure_no_further_command_starts_when_asked():
    results = run_bounded([["true"], ["false"], ["true"]], limit=1, timeout=10, stop_on_failure=True)
    assert [r[0] for r in results] == [0, 1, None] and results[2] == NOT_RUN
    assert [r[0] for r in run_bounded([["true"], ["false"], ["true"]], limit=1, timeout=10)] == [0, 1, 0]


@pytest.fixture
def mute_ports():
    """Two ports that accept TCP connections and never speak: ssh waits out its ConnectTimeout."""
    socks = [socket.socket() for _ in range(2)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
            s.listen(8)
        yield [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_detached_start_failing_on_two_hosts_names_both_and_stops_the_started(ssh_cluster, tmp_path, mute_ports):
    dead = mute_ports  # slow failures: the other hosts of the wave start meanwhile
    hosts = [f"root@{ssh_cluster.hosts[0].line}", f"root@127.0.0.1:{dead[0]}", f"root@127.0.0.1:{dead[1]}",
             f"root@{ssh_cluster.hosts[1].line}"]
    spec = LaunchSpec(command=SLEEPER, nodes=4, procs_per_node=1, backend="ssh", device="cpu",
                      run_dir=str(tmp_path / "run"), stop_grace=2,
                      backend_options={"hosts": hosts, "fanout": 4, **ssh_cluster.ssh_settings(),
                                       "connect_timeout": 2})
    launcher = Launcher(spec, sink=lambda line: None)
    try:
        with pytest.raises(LaunchError) as err:
            launcher.submit_detached()
        message = str(err.value)
        assert f"node 1 on root@127.0.0.1:{dead[0]} (exit 255)" in message
        assert f"node 2 on root@127.0.0.1:{dead[1]} (exit 255)" in message
        assert "starting 2 of 4 node(s) over ssh failed" in message and "stopped the 2 started" in message
        # The two hosts that started were stopped: exit records say so, and nothing of the job runs.
        run_dir = launcher.job.run_dir
        for node in (0, 3):
            with open(paths(run_dir, node)["exit"], encoding="utf-8") as fh:
                assert json.load(fh)["stopped_by_signal"] == signal.SIGTERM
        assert wait_for(lambda: still_alive(job_processes(launcher.job.job_id)) == [], timeout=15)
    finally:
        for proc in job_processes(launcher.job.job_id if launcher.job else "never-started"):
            proc.kill()


@pytest.fixture
def detached_job(ssh_cluster, tmp_path):
    """A 2-host detached job whose ranks sleep; stopped (and its masters closed) at teardown."""
    spec = LaunchSpec(command=SLEEPER, nodes=2, procs_per_node=1, backend="ssh", device="cpu",
                      run_dir=str(tmp_path / "run"), stop_grace=2,
                      backend_options={"hostfile": ssh_cluster.hostfile(1), **ssh_cluster.ssh_settings()})
    launcher = Launcher(spec, sink=lambda line: None)
    handle = launcher.submit_detached()
    try:
        yield launcher.backend, handle
    finally:
        nodes.stop_job(launcher.backend._target(handle), handle.run_dir, grace=2)
        asyncio.run(launcher.backend._close_masters(launcher.backend._target(handle), launcher.backend._mux_dir(handle)))
        for proc in job_processes(handle.job_id):
            proc.kill()


def test_a_running_job_is_watched_from_the_shared_filesystem_and_only_a_stale_node_is_asked(detached_job):
    backend, handle = detached_job
    target, mux_dir = backend._target(handle), backend._mux_dir(handle)
    status, asked = asyncio.run(nodes.async_query_job(target, handle.run_dir, mux_dir))
    assert (status.state, status.done, asked) == ("RUNNING", False, [])  # no ssh at all
    assert not os.path.exists(mux_dir)  # nor a socket directory

    # Node 1's daemon dies without a record (a host crash), and its heartbeat goes stale.
    beat = paths(handle.run_dir, 1)["beat"]
    with open(paths(handle.run_dir, 1)["state"], encoding="utf-8") as fh:
        os.kill(json.load(fh)["pid"], signal.SIGKILL)
    # its age is the file's ctime, which no one can back-date: wait until it is stale
    assert wait_for(lambda: status_from_files(handle.run_dir, 1, time.time(), nodes.stale_after()) is None,
                    timeout=nodes.stale_after() + 10, interval=0.5), beat

    status, asked = asyncio.run(nodes.async_query_job(target, handle.run_dir, mux_dir))
    assert asked == [1]  # only the stale node, over ssh: its host says the daemon is gone
    assert (status.state, status.failed_node) == ("LOST", 1), status
    assert control.live_sockets(mux_dir) == [1]  # the ssh call left a master to reuse

    # The backend's poll closes the job's masters once the job is over.
    assert asyncio.run(backend.async_poll(handle)).state == "LOST"
    assert control.live_sockets(mux_dir) == [] and not os.path.exists(mux_dir)


def test_shared_status_reads_exit_records_and_fresh_heartbeats(tmp_path):
    run_dir = str(tmp_path)
    files = paths(run_dir, 0)
    os.makedirs(os.path.dirname(files["beat"]))
    now = time.time()
    assert status_from_files(run_dir, 0, now, 15) is None  # nothing yet: ask the host
    open(files["beat"], "w").close()
    assert status_from_files(run_dir, 0, time.time(), 15)["state"] == "running"
    assert status_from_files(run_dir, 0, time.time() + 16, 15) is None  # stale
    with open(files["log"], "w", encoding="utf-8") as fh:
        fh.write("Traceback\nRuntimeError: boom\n")
    key = JobKey("job", "ab" * 32)  # the daemon signs its record with the job's secret
    with open(files["exit"], "w", encoding="utf-8") as fh:
        json.dump(key.sign("exit", 0, {"exit_code": 3, "stopped_by_signal": None, "time": time.time()}), fh)
    got = status_from_files(run_dir, 0, time.time() + 100, 15, key=key)  # an exit record needs no heartbeat
    assert (got["state"], got["exit_code"], got["tail"][-1]) == ("exited", 3, "RuntimeError: boom")


def test_control_socket_directory_must_be_private_and_ours(tmp_path):
    root = tmp_path / f"dtrain-ssh-{os.getuid()}"
    path = control.control_dir("job", base=str(tmp_path))
    assert os.path.dirname(path) == str(root) and (os.stat(path).st_mode & 0o777) == 0o700
    default = control.control_dir("job")  # where real sockets go: its names fit a unix socket path
    try:
        assert len(control.socket_path(default, 9999) + ".XXXXXXXXXXXXXXXX") < 108  # with ssh's temp suffix
    finally:
        control.remove_dir(default)

    os.chmod(root, 0o755)  # another user could swap our sockets
    with pytest.raises(LaunchError, match="mode 0700"):
        control.control_dir("job", base=str(tmp_path))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    link_base = tmp_path / "b"
    link_base.mkdir()
    os.symlink(elsewhere, link_base / f"dtrain-ssh-{os.getuid()}")  # planted by someone else
    with pytest.raises(LaunchError, match="not a symlink"):
        control.control_dir("job", base=str(link_base))
    assert os.listdir(elsewhere) == []
