"""An attacker on the training network against an elastic job's rendezvous store, on hosts with their
own addresses (tests/netcluster.py) over the ssh backend: the store listens only at the address the
agents use; a process of another user (uid 65534) on a training host that reaches it, lists its keys,
plants a pickle as the rendezvous state and declares every node lost, runs no code in any agent and
removes no node; the agents refuse the planted values (named in the job's log), and the job goes on to
its end."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch.backends.ssh.faults.test_elastic import ELASTIC_TRAIN, Run, nothing_left, round_nodes
from tests.remote_jobs import needs_sshd
from tests.services import _net_ssh_cluster

pytestmark = [needs_sshd, pytest.mark.timeout(420)]

ATTACK = str(Path(__file__).parent / "scripts" / "rdzv_attack.py")
STORE_LINE = re.compile(r"rendezvous store on this host \((\S+):(\d+)\)")


@pytest.fixture
def two_hosts(tmp_path_factory):
    yield from _net_ssh_cluster(2, str(tmp_path_factory.mktemp("rdzv-tamper")))


def this_hosts_addresses() -> list[str]:
    """Every IPv4 address of this machine's own network namespace (where the launcher runs)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines()]


def reachable(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=3).close()
        return True
    except OSError:
        return False


def test_a_planted_pickle_and_a_forged_lost_list_from_another_user_are_refused(two_hosts, tmp_path):
    net = two_hosts.net
    marker = tmp_path / "code-ran-in-an-agent"
    run = Run(two_hosts, tmp_path, [sys.executable, ELASTIC_TRAIN, str(tmp_path / "out"), "--until-file",
                                    str(tmp_path / "stop")], nodes="1:2")
    try:
        run.wait_for("[dtrain] round 0: 2 node(s)", 120)
        run.wait_for_checkpoint(past=0)
        address, port = next(STORE_LINE.search(line).groups() for line in run.lines if STORE_LINE.search(line))
        port = int(port)
        assert address == net.gateway, run.log()  # the address on the hosts' route
        others = [a for a in this_hosts_addresses() if a != address]
        exposed = [a for a in others if reachable(a, port)]
        attack = net.hosts[1].run([sys.executable, ATTACK, address, str(port), str(marker), "5"], timeout=120)
        assert attack.returncode == 0 and "uid=65534" in attack.stdout, attack.stdout + attack.stderr
        time.sleep(3)  # the agents' next reads of the state and of the lost list
        (tmp_path / "stop").touch()
        result = run.result(180)
    finally:
        (tmp_path / "stop").touch()
        run.launcher.terminate()
        run.thread.join(60)
    log = run.log()
    assert not marker.exists(), marker.read_text()
    assert "127.0.0.1" in others and exposed == [], others  # the store listens at the agents' address only
    assert result.exit_code == 0, log
    assert round_nodes(result) == [[0, 1]], (result.rounds, log)  # no node was removed: no round re-formed
    assert run.said(f"refused the value of 'torch.rendezvous.{result.job_id}'"), log
    assert run.said("refused the value of 'dtrain.lost'"), log
    nothing_left(result.job_id)
