"""A node lost mid-training in the modes where no ssh session holds the job: durable (the operator's
default: a detached job the worker follows by polling, Launcher.submit_detached + attach) and deferred
(the trigger follows it). On the namespace cluster (tests/netcluster.py), with real sshd.

Each node's daemon holds a lease (detached_node.hold_lease): cut off from its peer's login port for
lost_after seconds, or frozen that long, it fences itself (stops its ranks, records why, exit 255). The
watcher names the lost node from its heartbeat, the fence records and one look at each suspect's login
port (dtrain.launch.backends.ssh.detached.lost_node_of). The shared filesystem here stays visible to a
partitioned host (one disk), so the heartbeat alone cannot tell a partition: the fence does."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dtrain.errors import LaunchError
from dtrain.launch.backends import get_backend_class
from dtrain.launch.backends.ssh.detached_node import paths
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine import retry
from dtrain.launch.engine.launcher import Launcher
from tests.launch.backends.ssh.faults.test_lost_node import SHORT_LOST_AFTER, finish, on_host
from tests.remote_jobs import needs_sshd, reports, train_command
from tests.support import poll_until

pytestmark = [needs_sshd, pytest.mark.timeout(300)]


def spec_for(cluster, tmp_path, **ssh) -> LaunchSpec:
    return LaunchSpec(command=train_command("--steps", "2", "--hang"), nodes=2, procs_per_node=1, backend="ssh",
                      device="cpu", run_dir=str(tmp_path / "run"), stop_grace=2.0,
                      backend_options={"hostfile": cluster.hostfile(1), **cluster.ssh_settings(),
                                       "poll_interval": 1, "max_poll_interval": 5, **ssh})


def start_durable(cluster, tmp_path, **ssh):
    """Submit detached and follow it as the operator's durable mode does, in a thread."""
    lines: list[str] = []
    launcher = Launcher(spec_for(cluster, tmp_path, **ssh), sink=lines.append)
    handle = launcher.submit_detached()
    assert poll_until(lambda: len(reports(handle.run_dir)) == 2, 120, 0.2), "\n".join(lines[-40:])
    results = []
    thread = threading.Thread(target=lambda: results.append(launcher.attach(handle)), daemon=True)
    thread.start()
    return handle, thread, results, lines


def assert_lost(result, net, lines, fault: str):
    """The verdict names node 1, its address and ``fault``; the retry policy retries; node 0 is cleaned."""
    expected = (255, 1, 1, net.hosts[1].address, fault)
    assert (result.exit_code, result.failed_node, *(result.lost.get(k) for k in ("node", "address", "fault"))) \
        == expected, "\n".join(lines[-40:])
    with pytest.raises(LaunchError) as raised:
        result.raise_for_status()
    assert f"node 1 ({net.hosts[1].address}) lost: {fault} (" in str(raised.value)
    assert retry.classify(raised.value).action == retry.RETRY  # the lost-node class: the retry resumes
    assert poll_until(lambda: on_host(net, 0, result.job_id) == [], 30, 0.2), on_host(net, 0, result.job_id)


def fence_reason(run_dir: str, node: int) -> str:
    with open(paths(run_dir, node)["log"], encoding="utf-8", errors="replace") as fh:
        return "".join(line for line in fh if "fencing" in line)


def test_durable_a_partitioned_node_fences_itself_and_is_named(faulty_cluster, tmp_path):
    """Default settings (lost_after 30 s): the cut-off node fences itself within its lease, still cut off."""
    net = faulty_cluster.net
    handle, thread, results, lines = start_durable(faulty_cluster, tmp_path)
    net.partition(1)
    try:
        result = finish(thread, results, lines, bound=120)
        assert_lost(result, net, lines, "unreachable")
        assert poll_until(lambda: on_host(net, 1, handle.job_id) == [], 60, 0.5), on_host(net, 1, handle.job_id)
        assert "could not reach its peer" in fence_reason(handle.run_dir, 1)
    finally:
        net.heal(1)
    assert on_host(net, 1, handle.job_id) == []  # healed: nothing of the old job to collide with a retry


def test_durable_a_frozen_node_is_named_and_fences_itself_when_it_thaws(faulty_cluster, tmp_path):
    net = faulty_cluster.net
    handle, thread, results, lines = start_durable(faulty_cluster, tmp_path, lost_after=SHORT_LOST_AFTER)
    net.freeze(1)
    try:
        result = finish(thread, results, lines, bound=90)
        assert_lost(result, net, lines, "frozen")
        assert on_host(net, 1, handle.job_id)  # frozen: nothing there can act yet
    finally:
        net.thaw(1)
    assert poll_until(lambda: on_host(net, 1, handle.job_id) == [], 30, 0.2), on_host(net, 1, handle.job_id)
    assert "frozen or suspended" in fence_reason(handle.run_dir, 1)


def submit_deferred(backend_name: str, spec: LaunchSpec):
    """Submit as the deferred operator does (detached, with its submission record); (backend, handle) once
    both ranks trained their steps."""
    from dtrain.launch.airflow.deferrable import write_submission
    from dtrain.launch.core.job import prepare_job

    backend = get_backend_class(backend_name)(sink=lambda line: None)
    handle = backend.submit(prepare_job(spec), detached=True)
    write_submission(handle)
    assert poll_until(lambda: len(reports(handle.run_dir)) == 2, 120, 0.2)
    return backend, handle


def first_event(handle, timeout: float = 90) -> dict:
    """The first event of the deferred mode's trigger watching ``handle``."""
    from dtrain.launch.airflow.trigger import DistributedJobTrigger

    trigger = DistributedJobTrigger(handle=handle.to_dict(), poll_interval=1, max_poll_interval=5)

    async def first():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(asyncio.wait_for(first(), timeout))


def assert_resumed_lost(event: dict, net, handle, fault: str) -> None:
    """The event names node 1, its address and ``fault``; the task's resume raises the lost-node verdict
    (retried) and stops node 0."""
    from dtrain.launch.airflow.deferrable import resume_job

    assert event["status"] == "failed" and event["state"] == "LOST", event
    assert (event["lost"]["node"], event["lost"]["address"], event["lost"]["fault"]) == \
        (1, net.hosts[1].address, fault), event
    with pytest.raises(LaunchError) as raised:
        resume_job(None, event)
    assert raised.value.exit_code == 255 and retry.classify(raised.value).action == retry.RETRY
    assert f"node 1 ({net.hosts[1].address}) lost: {fault} (" in str(raised.value)
    assert poll_until(lambda: on_host(net, 0, handle.job_id) == [], 30, 0.2), on_host(net, 0, handle.job_id)


def test_deferred_a_crashed_node_is_named_gone(faulty_cluster, tmp_path):
    """The trigger's watch; the task's resume raises the lost-node verdict and stops the other node."""
    net = faulty_cluster.net
    backend, handle = submit_deferred("ssh", spec_for(faulty_cluster, tmp_path, lost_after=SHORT_LOST_AFTER))
    try:
        net.crash(1)
        assert_resumed_lost(first_event(handle), net, handle, "gone")
    finally:
        backend.cancel(handle)
    assert on_host(net, 1, handle.job_id) == []


def test_durable_a_crashed_node_is_named_gone_with_default_settings(faulty_cluster, tmp_path):
    """Its heartbeat goes stale (15 s) and ssh is refused: one probe says gone, before the polls that
    could not ask the host add up to "lost track" (5 of them, 2 s apart here)."""
    net = faulty_cluster.net
    handle, thread, results, lines = start_durable(faulty_cluster, tmp_path)
    net.crash(1)
    result = finish(thread, results, lines, bound=60)
    assert_lost(result, net, lines, "gone")
    assert on_host(net, 1, handle.job_id) == []
