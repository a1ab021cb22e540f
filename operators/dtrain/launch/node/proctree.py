"""Stop a job's processes on this host: its process tree, and whatever escaped the tree.

Descendants are signalled one by one rather than by process group, because torchrun gives
each worker a session of its own. A process that left the tree (``setsid`` and its parent
gone: re-parented to init) is still found by the ``DTRAIN_JOB_ID`` it inherited in its
environment. Used by the local supervisor, the SSH agents, the detached nodes and every
Slurm node task (``python -m dtrain.launch.node.proctree reap JOB_ID``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import MutableMapping

#: set by the Slurm node shell to its own pid for the agent it starts (:func:`die_with_parent`)
PARENT_ENV = "DTRAIN_AGENT_PARENT"
PR_SET_PDEATHSIG = 1


def parent_death_signal(signum: int) -> bool:
    """Have the kernel send ``signum`` to this process when its parent ends (PR_SET_PDEATHSIG);
    False where that is not available."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        return True
    except (OSError, AttributeError):
        return False


def die_with_parent(environ: MutableMapping[str, str], signum: int = signal.SIGTERM) -> None:
    """When ``environ`` names this process's parent (:data:`PARENT_ENV`), the kernel sends ``signum``
    to this process when that parent ends, or it is sent now if the parent ended already. The name
    is taken out of ``environ``: the agent's ranks must not inherit it.

    Why: Slurm's proctrack/linuxproc finds a job's processes by parent links at the moment it kills;
    a node shell SIGKILLed by ``scancel --full`` could leave its agent re-parented to init and waiting
    in the rendezvous (an agent can outlive a cancelled job by more than 15 s that way)."""
    expected = environ.pop(PARENT_ENV, "")
    if not expected.isdigit() or not parent_death_signal(signum):
        return
    if os.getppid() != int(expected):  # the parent died before prctl: no signal will come
        os.kill(os.getpid(), signum)


def kill_tree(root, grace: float, job_id: str | None = None, node: int | None = None) -> None:
    """``root`` is a psutil.Process; it is not signalled itself, only its descendants, and then,
    with ``job_id``, every other process of that job (and ``node``) on this host: those that
    left the tree."""
    _kill_descendants(root, grace)
    if job_id:
        kill_job(job_id, grace, node)


def _kill_descendants(root, grace: float) -> None:
    import psutil

    for attempt in range(2):
        try:
            victims = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        if not victims:
            return
        for proc in victims:
            try:
                proc.send_signal(signal.SIGTERM if attempt == 0 else signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        alive = wait_gone(victims, timeout=grace if attempt == 0 else 2.0)
        if attempt == 1:
            for proc in alive:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass


#: Linux caps a process's argv and environment at 6 MiB together (3/4 of the 8 MiB stack limit);
#: no more than this is read of one, whatever /proc says
MAX_ENVIRON_BYTES = 8 * 1024 * 1024


def environ_of(pid: int, limit: int = MAX_ENVIRON_BYTES, needle: bytes | None = None) -> dict[str, str] | None:
    """The environment process ``pid`` started with (``/proc/PID/environ``, at most ``limit`` bytes
    read, a cut last entry dropped); None when it cannot be read (gone, another user's), or, with
    ``needle``, when those bytes are not in it (a scan of every process parses only the candidates)."""
    try:
        with open(f"/proc/{int(pid)}/environ", "rb") as fh:
            raw = fh.read(limit + 1)
    except OSError:
        return None
    if needle is not None and needle not in raw[:limit]:
        return None
    entries = raw[:limit].split(b"\0")
    if len(raw) > limit or entries[-1]:
        entries = entries[:-1]
    environ = {}
    for entry in entries:
        name, sep, value = entry.partition(b"=")
        if sep:
            environ[name.decode(errors="replace")] = value.decode(errors="replace")
    return environ


def of_job(environ: dict[str, str] | None, job_id: str, node: int | None = None) -> bool:
    """Whether an environment says ``DTRAIN_JOB_ID=job_id`` (and ``DTRAIN_NODE_INDEX=node`` when
    given: two nodes of a job may share a host)."""
    return (environ is not None and environ.get("DTRAIN_JOB_ID") == job_id
            and (node is None or environ.get("DTRAIN_NODE_INDEX") == str(node)))


def job_processes(job_id: str, node: int | None = None) -> list:
    """This user's processes on this host of job ``job_id`` (and ``node``: :func:`of_job`), except
    this process and its ancestors (a launcher may carry the variables itself)."""
    return processes_where(lambda environ: of_job(environ, job_id, node),
                           needle=f"DTRAIN_JOB_ID={job_id}".encode(errors="replace"))


def network_namespace(pid: int | str = "self") -> str | None:
    """The network namespace of process ``pid`` (``net:[inode]``; None when it cannot be read)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def processes_where(predicate, needle: bytes | None = None) -> list:
    """This user's live processes on this host whose environment satisfies ``predicate`` (and holds
    the bytes ``needle``, when given: what ``predicate`` cannot do without), except this process and
    its ancestors. "This host" is this network namespace: hosts simulated as namespaces of one
    machine share its process table, and a host's cleanup must not reach what runs on another (on
    separate machines it cannot).

    Every launch ends with this scan of the host's process table, so a process is looked at no
    further than its environment unless that environment matches."""
    import psutil

    me = psutil.Process()
    spared = {me.pid, *(p.pid for p in me.parents())}
    here = network_namespace()
    found = []
    for pid in psutil.pids():
        if pid in spared:
            continue
        environ = environ_of(pid, needle=needle)
        if environ is None or not predicate(environ):
            continue
        elsewhere = network_namespace(pid)
        if here is not None and elsewhere is not None and elsewhere != here:
            continue
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_job(job_id: str, grace: float, node: int | None = None) -> int:
    """SIGTERM every process of the job (or of its ``node``) on this host, SIGKILL what is left
    after ``grace``; returns how many there were."""
    victims = job_processes(job_id, node)
    kill_processes(victims, grace)
    return len(victims)


def kill_processes(victims: list, grace: float) -> None:
    """SIGTERM each of ``victims`` (psutil.Process), SIGKILL those left after ``grace`` seconds."""
    import psutil

    for proc in victims:
        _signal(proc, signal.SIGTERM)
    alive = wait_gone(victims, timeout=grace)
    for proc in alive:
        _signal(proc, signal.SIGKILL)
    wait_gone(alive, timeout=2.0)


def wait_gone(victims: list, timeout: float, interval: float = 0.05) -> list:
    """Wait until each of ``victims`` (psutil.Process) has ended or ``timeout`` passed; returns those
    still alive. A zombie counts as ended, and none is reaped: ``psutil.wait_procs`` reaps a child of
    ours with ``waitpid``, and the ``subprocess.Popen`` waiting on that child then gets ECHILD and
    reports exit status 0. A node agent whose rank was SIGKILLed by its fence can exit 0 that way
    (under load): a stopped node reported as a successful one."""
    deadline = time.monotonic() + timeout
    alive = list(victims)
    while True:
        alive = [proc for proc in alive if _running(proc)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(interval)


def _running(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(proc, signum: int) -> None:
    import psutil

    try:
        proc.send_signal(signum)
    except psutil.NoSuchProcess:
        pass


def main(argv: list[str] | None = None) -> int:
    import argparse  # the reaper's command line only: every rank wrapper imports this module

    parser = argparse.ArgumentParser(prog="python -m dtrain.launch.node.proctree")
    sub = parser.add_subparsers(dest="verb", required=True)
    reap = sub.add_parser("reap", help="stop every process of a job left on this host")
    reap.add_argument("job_id")
    reap.add_argument("--node", type=int, help="only this node's processes (DTRAIN_NODE_INDEX)")
    reap.add_argument("--grace", type=float, default=5.0)
    args = parser.parse_args(argv)
    count = kill_job(args.job_id, args.grace, args.node)
    if count:
        print(f"[dtrain] stopped {count} process(es) of job {args.job_id} left on {os.uname().nodename}",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
