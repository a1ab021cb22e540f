"""Supervise one process per node: start, stream output, notice the first failure, tear down.

Used by every backend that holds a local process per node (the local backend's
torchrun agents; the SSH backend's ssh clients). Each node process starts in its
own session, so a whole node can be signalled at once; teardown also signals every
descendant found at that moment, since torchrun puts each worker in a session of
its own.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import ctypes

import psutil

from dtrain.launch.backends.base import LineSink, print_sink  # the output contract every backend shares
from dtrain.launch.node.proctree import kill_job, wait_gone

PR_SET_PDEATHSIG = 1
# Resolved before any fork: the pre-exec hook must not import or allocate in the child.
_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


def _die_with_launcher() -> None:
    """Runs in the child before exec: if the launcher is SIGKILLed, the kernel sends the node
    process SIGTERM, and torchrun's SIGTERM handling stops its workers (no orphans)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

TAIL_LINES = 40
#: the longest a follower sleeps between two checks when no node process ended (each end wakes it
#: at once: :meth:`NodeSupervisor.wait_for_change`); a bound in case a wake-up is ever missed
IDLE_CHECK_S = 1.0


@dataclass
class NodeProcess:
    index: int
    argv: list[str]
    proc: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None


class NodeSupervisor:
    """Starts ``argvs[i]`` for node i and watches them until all succeed or one fails."""

    def __init__(self, sink: LineSink = print_sink, poll_interval: float = 0.02, grace_seconds: float = 5.0,
                 job_id: str | None = None):
        self.sink = sink
        self.job_id = job_id  # teardown also stops processes of the job that left the tree
        self.poll_interval = poll_interval
        # Seconds between SIGTERM and SIGKILL in teardown(): a backend sets it from the spec's
        # stop_grace at submit (a rank's time to save a checkpoint); spent only while one still runs.
        self.grace_seconds = grace_seconds
        self.nodes: list[NodeProcess] = []
        #: where a node's agent lines go once the job is being stopped (node index, line); None: the sink.
        #: A stop makes every torchrun agent print its shutdown (warnings, tracebacks); the launcher
        #: reports the verdict once, so a backend sends those lines to the run directory. The ranks'
        #: own lines (a checkpoint saved on SIGTERM) still reach the sink.
        self.stopping_sink: Callable[[int, str], None] | None = None
        self._stop = threading.Event()
        #: set when a node process ends (or stop()): what :meth:`wait_for_change` sleeps on
        self._changed = threading.Event()
        self._lock = threading.Lock()
        self._teardown_lock = threading.RLock()
        self._tearing_down = False
        self.stop_reason: str | None = None

    def start(self, argvs: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], cwd: str | None = None,
              stagger_seconds: float = 0.0, stdin: bytes | None = None) -> None:
        """Start one process per argv; ``stdin``: what each reads on its stdin (then EOF), else nothing."""
        for index, (argv, env) in enumerate(zip(argvs, envs)):
            if self._stop.is_set():
                return
            proc = subprocess.Popen(
                list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_launcher,
            )
            if stdin is not None:
                try:
                    proc.stdin.write(stdin)
                    proc.stdin.close()
                except BrokenPipeError:
                    pass  # it ended already: its exit status reports it
            node = NodeProcess(index=index, argv=list(argv), proc=proc)
            node.reader = threading.Thread(target=self._pump, args=(node,), daemon=True)
            node.reader.start()
            threading.Thread(target=self._await_exit, args=(proc.pid,), daemon=True).start()
            with self._lock:
                self.nodes.append(node)
            if stagger_seconds and index == 0:
                time.sleep(stagger_seconds)

    def _pump(self, node: NodeProcess) -> None:
        for raw in iter(node.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            node.tail.append(line)
            ranks_own = line.startswith("[node")  # a rank's line (rank_entry prefixes them): always the user's
            if self._stop.is_set() and self.stopping_sink is not None and not ranks_own:
                self.stopping_sink(node.index, line)  # the agent's shutdown chatter
            else:
                self.sink(line if ranks_own else f"[node{node.index}] {line}")

    def _await_exit(self, pid: int) -> None:
        """Wake :meth:`wait_for_change` when node process ``pid`` ends. ``WNOWAIT`` leaves it unreaped:
        its exit status stays for its ``Popen`` (see :func:`dtrain.launch.node.proctree.wait_gone`)."""
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except (ChildProcessError, OSError):
            pass  # reaped already by a poll(): it ended
        self._changed.set()

    def wait_for_change(self, timeout: float) -> None:
        """Sleep until a node process ends or :meth:`stop` is called (at most ``timeout`` seconds),
        so a follower checks on an event instead of polling on a short interval. Returns at once
        when one ended since the previous call; what a following :meth:`check` reads is current."""
        self._changed.wait(timeout)
        self._changed.clear()  # before the check that follows: an exit after this sets it again

    def check(self, expected: int) -> tuple[bool, int, NodeProcess | None]:
        """Without blocking: (done, exit code, failed node). Done when one node failed (its code and
        node) or all ``expected`` nodes exited 0 (0, None)."""
        with self._lock:
            nodes = list(self.nodes)
        codes = [n.proc.poll() for n in nodes]
        for node, code in zip(nodes, codes):
            if code not in (None, 0):
                if node.reader is not None:  # its last lines (why it failed) may still be in the pipe
                    node.reader.join(timeout=5)
                return True, code, node
        if len(nodes) == expected and all(c == 0 for c in codes):
            self._drain()
            return True, 0, None
        return False, 0, None

    def latest(self) -> dict[int, NodeProcess]:
        """Each node's latest process (a node brought back runs a new one)."""
        with self._lock:
            return {node.index: node for node in self.nodes}

    def wait(self, expected: int) -> tuple[int, NodeProcess | None]:
        """Block until every node exits 0 (returns 0, None), one fails (its code and node), or stop()."""
        while not self._stop.is_set():
            done, code, node = self.check(expected)
            if done:
                return code, node
            self.wait_for_change(IDLE_CHECK_S)
        return -1, None

    def stop(self, reason: str = "stop requested") -> None:
        """Ask wait() to return; the caller then calls teardown(). Safe from signal handlers."""
        self.stop_reason = self.stop_reason or reason
        self._stop.set()
        self._changed.set()

    def pids(self) -> set[int]:
        """Every live process of the job: node processes and all their descendants."""
        found: set[int] = set()
        with self._lock:
            nodes = list(self.nodes)
        for node in nodes:
            try:
                root = psutil.Process(node.proc.pid)
                found.add(root.pid)
                found.update(child.pid for child in root.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        return found

    def teardown(self, grace: float | None = None) -> None:
        """SIGTERM every node's process group and every descendant; SIGKILL what is left after the
        grace period (``grace``, default :attr:`grace_seconds`). The wait ends as soon as every
        process is gone, so a job whose ranks exit at once is torn down at once.

        Each process gets one SIGTERM from here: a node's process group is signalled as a whole
        and the descendants outside it one by one (a torchrun agent that got SIGTERM twice cuts
        its own wait for the workers short). Re-entrant calls (a signal handler interrupting a
        teardown on the same thread) return at once; other threads wait for the running one.
        """
        with self._teardown_lock:
            if self._tearing_down:
                return  # this thread is already tearing down, below us on the stack
            self._tearing_down = True
            try:
                self._teardown(self.grace_seconds if grace is None else grace)
            finally:
                self._tearing_down = False

    def _teardown(self, grace: float) -> None:
        self._stop.set()
        for attempt in range(2):
            victims = self._snapshot()
            if not victims:
                break
            with self._lock:
                nodes = list(self.nodes)
            groups = set()
            for node in nodes:
                if node.proc.poll() is None:
                    _signal_group(node.proc.pid, signal.SIGTERM)
                    groups.add(node.proc.pid)
            for proc in victims:
                if attempt == 0 and _pgid(proc.pid) in groups:
                    continue  # signalled with its node's group just now
                _signal(proc, signal.SIGTERM)
            alive = wait_gone(victims, timeout=grace if attempt == 0 else 1.0)  # reaps none: node.proc's status stays ours
            for proc in alive:
                _signal(proc, signal.SIGKILL)
            wait_gone(alive, timeout=2.0)
        for node in self.nodes:
            try:
                node.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                node.proc.kill()
        if self.job_id:
            kill_job(self.job_id, grace)
        self._drain()

    def _snapshot(self) -> list[psutil.Process]:
        victims = []
        for pid in self.pids():
            try:
                victims.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
        return victims

    def _drain(self) -> None:
        for node in self.nodes:
            if node.reader is not None:
                node.reader.join(timeout=5)


class AgentLogs:
    """A stopping sink (:attr:`NodeSupervisor.stopping_sink`): each node's lines appended to
    ``<run_dir>/logs/agent<node>.log``, never through a link (dtrain.rundir)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self, node: int, line: str) -> None:
        from dtrain.rundir import LOGS, RunDir, UnsafeRunDir

        try:
            fd = RunDir(self.run_dir).open_append(LOGS, f"agent{int(node)}.log")
        except (OSError, UnsafeRunDir):
            return  # a planted link or a full disk costs these lines, never the teardown
        try:
            os.write(fd, (line + "\n").encode(errors="replace"))
        except OSError:
            pass
        finally:
            os.close(fd)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(proc: psutil.Process, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
