"""The Slurm node shell (``render.NODE_SHELL``, what srun runs on every node) with the real torchrun agent,
outside Slurm: when ``scancel --full`` SIGKILLs the shell, no trap of it runs, and Slurm's proctrack/linuxproc
can miss a child the kill re-parented; the agent must end by itself (the kernel's parent-death signal).

A clean-clone run of the suite (at 93d6aee) failed on a torchrun agent that outlived a cancelled Slurm job
by more than 15 s (tests/launch/backends/slurm/remote/test_deferrable.py::test_trigger_on_kill_cancels_the_job)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil

from dtrain.launch.backends.slurm.render import NODE_SHELL, node_argv
from dtrain.launch.core.job import Job, free_port
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.node.proctree import kill_processes
from tests.support import wait_for


def agent_of(shell: psutil.Process) -> psutil.Process | None:
    return next((child for child in shell.children()
                 if "dtrain.launch.node.torchrun_agent" in " ".join(child.cmdline())), None)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_agent_ends_when_scancel_sigkills_its_node_shell(tmp_path):
    spec = LaunchSpec(command=[sys.executable, "-c", "import time; time.sleep(300)"], nodes=2, procs_per_node=1,
                      backend="slurm", device="cpu")
    job = Job(spec=spec, job_id="dtrain-nodeshell", run_dir=str(tmp_path))
    env = dict(os.environ, SLURM_NODEID="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               DTRAIN_JOB_ID=job.job_id, DTRAIN_RUN_DIR=str(tmp_path))
    # Node 0 of 2: the agent holds the rendezvous store and waits for node 1, which never comes.
    shell = subprocess.Popen(["bash", "-c", NODE_SHELL, "dtrain-node", *node_argv(job, sys.executable)],
                             env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,  # srun's: no secrets line
                             stderr=subprocess.DEVNULL)
    agent = None
    try:
        agent = wait_for(lambda: agent_of(psutil.Process(shell.pid)), 60, what="the node shell's agent")
        wait_for(lambda: listening(int(env["MASTER_PORT"])), 90,
                 what="the agent's rendezvous store")  # in the rendezvous, torch imported
        shell.send_signal(signal.SIGKILL)
        shell.wait(timeout=10)
        gone, alive = psutil.wait_procs([agent], timeout=30)
        assert alive == [], "the agent outlived its SIGKILLed node shell (re-parented, still in the rendezvous)"
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait()
        if agent is not None and agent.is_running():
            kill_processes([agent], grace=1.0)


def test_the_parent_pid_is_taken_out_of_the_environment_and_junk_is_ignored():
    from dtrain.launch.node.proctree import PARENT_ENV, die_with_parent

    environ = {PARENT_ENV: "1; kill -9 -1", "KEEP": "1"}
    die_with_parent(environ)  # not a pid: nothing is armed, and the ranks will not inherit the name
    assert environ == {"KEEP": "1"}
