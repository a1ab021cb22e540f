"""A node lost mid-training on hosts with their own addresses (tests/netcluster.py), over the ssh backend:
partitioned (its link down), frozen (every process stopped) or crashed (every process killed).

Each ends the launch with the lost-node verdict (exit 255, the node, its address and the fault class;
the retry policy's lost-node class), the reachable node cleaned at once, and the lost node's ranks gone:
a partitioned node fences itself while still cut off (its lease lapsed), a frozen one as soon as it
thaws, so nothing of the old job is left to collide with the retry when the fault heals."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine import retry
from dtrain.launch.engine.launcher import Launcher
from tests.remote_jobs import job_processes, needs_sshd, reports, still_alive, train_command
from tests.support import poll_until

pytestmark = [needs_sshd, pytest.mark.timeout(300)]

#: lost_after for the faults whose detection time is not the point (the default, 30 s, for a partition)
SHORT_LOST_AFTER = 12.0


def on_host(net, index: int, job_id: str) -> list[str]:
    """The job's live processes on host ``index`` of the namespace cluster."""
    pids = net.hosts[index].pids()
    return still_alive([p for p in job_processes(job_id) if p.pid in pids])


def start(cluster, tmp_path, **ssh):
    return launch(LaunchSpec(command=train_command("--steps", "2", "--hang"), nodes=2, procs_per_node=1, backend="ssh",
                             device="cpu", run_dir=str(tmp_path / "run"), stop_grace=2.0,
                             backend_options={"hostfile": cluster.hostfile(1), **cluster.ssh_settings(), **ssh}))


def launch(spec: LaunchSpec):
    """``Launcher(spec).run()`` in a thread, once both ranks trained their steps: (launcher, thread, results, lines)."""
    lines: list[str] = []
    launcher = Launcher(spec, sink=lines.append)
    results = []
    thread = threading.Thread(target=lambda: results.append(launcher.run()), daemon=True)
    thread.start()
    # both ranks trained their steps (a real all-reduce across the hosts) and now run on
    assert poll_until(lambda: launcher.job is not None and len(reports(launcher.job.run_dir)) == 2, 120, 0.2), \
        "\n".join(lines[-40:])
    return launcher, thread, results, lines


def finish(thread, results, lines, bound: float, capsys=None, what: str = ""):
    """The launch's result once it ended, within ``bound`` seconds; with ``capsys``, prints how long the
    verdict and the end took after the fault (``what``: "slurm, frozen node"), for docs/faults.md."""
    cut = time.monotonic()
    verdict = poll_until(lambda: any(" lost: " in line for line in lines), bound, 0.2) and time.monotonic() - cut
    thread.join(timeout=max(1.0, bound - (time.monotonic() - cut)))
    assert not thread.is_alive(), f"no verdict {bound:g} s after the fault:\n" + "\n".join(lines[-40:])
    if capsys is not None:
        with capsys.disabled():
            print(f"\n[fault] {what}: verdict {verdict:.1f} s after the fault, launch ended after "
                  f"{time.monotonic() - cut:.1f} s")
    return results[0]


@contextlib.contextmanager
def partitioned(net, job_id: str, launched, bound: float, capsys=None, what: str = ""):
    """Cut host 1 off under the launch ``launched`` (thread, results, lines); yields the launch's result,
    the verdict checked (node 1 unreachable), while the host is still cut off; heals it after, and then
    nothing of the old job may be left on it (to collide with a retry)."""
    thread, results, lines = launched
    assert on_host(net, 1, job_id)
    net.partition(1)
    try:
        result = finish(thread, results, lines, bound, capsys, what)
        assert_lost(result, net, lines, "unreachable")
        yield result
    finally:
        net.heal(1)
    assert on_host(net, 1, job_id) == []


def freeze_and_thaw(net, job_id: str, launched, bound: float, capsys=None, what: str = ""):
    """Freeze host 1 under the launch ``launched`` (thread, results, lines): the verdict names it frozen
    while nothing there can act; thawed, its lease finds itself long lapsed and stops its ranks at once."""
    thread, results, lines = launched
    net.freeze(1)
    try:
        result = finish(thread, results, lines, bound, capsys, what)
        assert_lost(result, net, lines, "frozen")
        assert on_host(net, 1, job_id)  # frozen: nothing there can act yet
    finally:
        net.thaw(1)
    assert poll_until(lambda: on_host(net, 1, job_id) == [], 30, 0.2), on_host(net, 1, job_id)
    return result


def assert_lost(result, net, lines, fault: str):
    log = "\n".join(lines[-40:])
    assert result.exit_code == 255 and result.failed_node == 1, log
    assert (result.lost["node"], result.lost["address"], result.lost["fault"]) == (1, net.hosts[1].address, fault), log
    assert result.lost["message"].startswith(f"node 1 ({net.hosts[1].address}) lost: {fault} (")
    assert any(f"[dtrain] node 1 ({net.hosts[1].address}) lost: {fault}" in line for line in lines), log
    with pytest.raises(Exception) as raised:
        result.raise_for_status()
    assert result.lost["message"] in str(raised.value)
    assert retry.classify(raised.value).action == retry.RETRY  # the lost-node class: the retry resumes
    # the reachable node was cleaned by the launcher's teardown
    assert poll_until(lambda: on_host(net, 0, result.job_id) == [], 15, 0.2), on_host(net, 0, result.job_id)


def test_a_partitioned_node_is_named_and_fences_itself_while_still_cut_off(faulty_cluster, tmp_path):
    """Default settings: lost after 30 s of silence; the node's lease lapses after 30 s too."""
    net = faulty_cluster.net
    launcher, thread, results, lines = start(faulty_cluster, tmp_path)
    job_id = launcher.job.job_id
    with partitioned(net, job_id, (thread, results, lines), 120) as result:
        # still partitioned: the node stops its own ranks when its lease lapses (30 s), within the grace
        assert poll_until(lambda: on_host(net, 1, job_id) == [], 90, 0.5), on_host(net, 1, job_id)
        fenced = os.path.join(result.run_dir, "remote", "fenced-node1")
        assert os.path.isfile(fenced) and "lease lapsed" in open(fenced, encoding="utf-8").read()


def test_a_frozen_node_is_named_and_fences_itself_when_it_thaws(faulty_cluster, tmp_path):
    launcher, thread, results, lines = start(faulty_cluster, tmp_path, lost_after=SHORT_LOST_AFTER)
    freeze_and_thaw(faulty_cluster.net, launcher.job.job_id, (thread, results, lines), 90)


def test_a_crashed_node_is_named_gone_at_once(faulty_cluster, tmp_path):
    net = faulty_cluster.net
    launcher, thread, results, lines = start(faulty_cluster, tmp_path, lost_after=SHORT_LOST_AFTER)
    job_id = launcher.job.job_id
    net.crash(1)
    result = finish(thread, results, lines, bound=60)
    assert_lost(result, net, lines, "gone")
    assert on_host(net, 1, job_id) == []
