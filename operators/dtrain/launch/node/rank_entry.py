"""Per-rank entry point: ``python -m dtrain.launch.node.rank_entry CMD ARGS...``.

torchrun (or mpirun) starts this in place of the user's command, on every rank. It

* completes the env contract (NODE_RANK, and the OMPI_* mapping for mpirun), plus the
  ``deepspeed`` launcher's LOCAL_SIZE, CROSS_RANK and CROSS_SIZE;
* sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, unless set, to the interface this node reaches
  MASTER_ADDR through (dtrain.launch.node.netif);
* fills the command's placeholders (``{deepspeed_config}``, ``{local_rank}``...; see
  dtrain.launch.node.placeholders) and appends ``--local_rank=N`` when the launch asked for it;
* on local rank 0, holds the node's lease when the launcher asked for one (mpirun over ssh:
  dtrain.launch.node.lease.start_from_env): the node fences itself when cut off from its peers;
* runs the command as an argv list (no shell), in this process group, and makes the
  kernel kill it if this wrapper dies (PR_SET_PDEATHSIG), so no rank outlives its agent;
* streams the command's stdout and stderr line by line, prefixed ``[nodeN rankR]``, and keeps
  them in ``$DTRAIN_RUN_DIR/logs/rank<R>.log`` (dtrain.launch.node.ranklog; the Training tab's tails);
* writes an exit record (code, time, whether it was told to stop, last lines) into
  ``$DTRAIN_RUN_DIR/exits`` so the launcher can name the rank that failed first;
* removes the rank's DeepSpeed shared-memory all-reduce buffer once the command has ended
  (see dtrain.launch.node.ds_shm: DeepSpeed never does, 67 MB of RAM per rank per job);
* marks the rank as progressing whenever it prints a line, and, when the launcher asks for
  stack dumps (a hang), makes sure this rank's dump exists: the training helper's own, or
  ``py-spy dump`` of the command, or a note saying why there is none (see dtrain.launch.engine.hang).

Stdlib only (and psutil, when it must find the socket interface: dtrain.launch.node.netif), and imported by
nothing heavy: it is on every rank's start-up path.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time

from dtrain.launch.node import ds_shm, hang_files, placeholders, proctree
from dtrain.launch.node.env_contract import contract_from_env, deepspeed_launcher_env
from dtrain.launch.node.netif import socket_ifname_env
from dtrain.launch.node.ranklog import RankLog
from dtrain.rundir import EXITS, RunDir

TAIL_LINES = 40


def resolve_argv(command: list[str]) -> list[str]:
    """A ``.py`` script runs with this interpreter; a bare ``python`` means this interpreter too,
    so every rank uses the launcher's environment."""
    if command[0].endswith(".py"):
        return [sys.executable, *command]
    if command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


def rank_command(command: list[str], environ: dict[str, str]) -> list[str]:
    """This rank's argv: placeholders filled with its values, and ``--local_rank=N`` appended when the
    launch asked for it (what the ``deepspeed`` launcher passes; scripts reading ``args.local_rank``)."""
    argv = placeholders.fill(command, environ)
    if environ.get("DTRAIN_PASS_LOCAL_RANK") == "1":
        argv.append(f"--local_rank={environ.get('LOCAL_RANK', '0')}")
    return argv


#: the prefix of the variables through which a launcher asks for a node lease (dtrain.launch.node.lease)
LEASE_VARS_PREFIX = "DTRAIN_LEASE_"


def start_lease(environ: dict[str, str]) -> None:
    """:func:`dtrain.launch.node.lease.start_from_env`, its module imported only when the launch
    asked for a lease (mpirun over ssh): every other rank starts without its imports."""
    if any(name.startswith(LEASE_VARS_PREFIX) for name in environ):
        from dtrain.launch.node import lease

        lease.start_from_env(environ)


def _die_with_parent() -> None:
    proctree.parent_death_signal(signal.SIGKILL)


class RankProcess:
    def __init__(self, command: list[str], environ: dict[str, str]):
        self.environ = environ
        self.prefix = f"[node{environ.get('NODE_RANK', '?')} rank{environ.get('RANK', '?')}] ".encode()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.tail_lock = threading.Lock()
        self.stop_signal: int | None = None
        self.ended_at: float | None = None
        run_dir = environ.get("DTRAIN_RUN_DIR")
        self.progress = (hang_files.ProgressToucher(hang_files.progress_dir(run_dir), environ.get("RANK", "x"))
                         if run_dir else None)
        restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.log = RankLog(run_dir, environ.get("RANK", "x"),
                           header=f"rank {environ.get('RANK', '?')} on node {environ.get('NODE_RANK', '?')} started "
                                  f"(job {environ.get('DTRAIN_JOB_ID', '?')}, restart {restart})") if run_dir else None
        self.proc = subprocess.Popen(
            resolve_argv(command), env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        if run_dir:
            # started, which is not progress yet: a rank that imports torch and joins its group says
            # nothing for a while, and the watcher gives it longer than hang_timeout for that
            hang_files.mark_started(hang_files.progress_dir(run_dir), environ.get("RANK", "x"))

    def _pump(self, source, sink) -> None:
        for line in iter(source.readline, b""):
            if self.progress is not None:
                self.progress.touch()
            with self.tail_lock:
                self.tail.append(line.decode(errors="replace").rstrip("\n"))
            if self.log is not None:
                self.log.write(line if line.endswith(b"\n") else line + b"\n")
            sink.write(self.prefix + line if line.endswith(b"\n") else self.prefix + line + b"\n")
            sink.flush()

    def forward(self, signum: int, _frame=None) -> None:
        self.stop_signal = signum
        try:
            self.proc.send_signal(signum)
        except ProcessLookupError:
            pass

    def watch_parent(self) -> None:
        # If the torchrun agent is SIGKILLed we are re-parented: stop the command rather than orphan it.
        parent = os.getppid()
        while self.proc.poll() is None:
            if os.getppid() != parent:
                self.forward(signal.SIGKILL)
                return
            time.sleep(0.5)

    def run(self) -> int:
        pumps = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout.buffer), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr.buffer), daemon=True),
        ]
        for t in pumps:
            t.start()
        threading.Thread(target=self.watch_parent, daemon=True).start()
        if self.environ.get(hang_files.HANG_DIR_ENV):
            threading.Thread(target=self.ensure_stack_dump, args=(self.environ[hang_files.HANG_DIR_ENV],),
                             daemon=True).start()
        code = self.proc.wait()
        # When it ended, not when its output drained (the pumps may wait up to 5 s below): which
        # rank failed first is read from these times.
        self.ended_at = time.time()
        for t in pumps:
            t.join(timeout=5)
        if self.log is not None:
            self.log.close()
        return 128 - code if code < 0 else code

    def ensure_stack_dump(self, directory: str) -> None:
        """Once the launcher asks, give this rank's stack: the helper's dump if it answers in time,
        else py-spy's view of the command from outside, else a note saying why there is none."""
        while not hang_files.exists(hang_files.request_path(directory)):
            if self.proc.poll() is not None:
                return
            time.sleep(0.5)
        rank = self.environ.get("RANK", "x")
        target = hang_files.stack_path(directory, rank)
        deadline = time.monotonic() + hang_files.HELPER_DUMP_WAIT_S
        while time.monotonic() < deadline:
            if hang_files.exists(target):
                return
            time.sleep(0.2)
        try:
            hang_files.write_private(target, self.outside_stack().encode())
        except OSError:
            pass

    def outside_stack(self) -> str:
        import shutil  # only for a dump: every rank's wrapper imports this module

        header = f"# pid {self.proc.pid}, rank {self.environ.get('RANK', '?')}: dumped from outside by its wrapper\n"
        py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        if py_spy is None:
            return header + ("no stack: the command did not answer (it does not call dtrain.training.init_distributed) "
                             "and py-spy is not installed (pip install py-spy)\n")
        try:
            done = subprocess.run([py_spy, "dump", "--pid", str(self.proc.pid)], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return header + f"py-spy dump failed: {e}\n"
        output = (done.stdout + done.stderr).decode(errors="replace")
        return header + f"$ py-spy dump --pid {self.proc.pid}\n" + output[-hang_files.MAX_STACK_CHARS:]

    def write_exit_record(self, exit_code: int) -> None:
        run_dir = self.environ.get("DTRAIN_RUN_DIR")
        if not run_dir:
            return
        name = f"rank{self.environ.get('RANK', 'x')}.restart{self.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.json"
        record = {
            "rank": int(self.environ.get("RANK", -1)),
            "node_rank": int(self.environ.get("NODE_RANK", -1)),
            "local_rank": int(self.environ.get("LOCAL_RANK", -1)),
            "exit_code": exit_code,
            "stopped_by_signal": self.stop_signal,
            "time": self.ended_at if self.ended_at is not None else time.time(),
            "host": os.uname().nodename,
            "tail": list(self.tail),
        }
        try:
            RunDir(run_dir).write_json(EXITS, name, value=record)
        except (OSError, ValueError) as e:  # exits/ replaced by a link or a file: not written through
            print(f"[dtrain] rank {record['rank']}: exit record not written: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("usage: python -m dtrain.launch.node.rank_entry CMD [ARGS...]", file=sys.stderr)
        return 2
    environ = dict(os.environ)
    environ.update(contract_from_env(environ))
    environ.update(socket_ifname_env(environ))  # after the contract: MASTER_ADDR may come from mpirun's variables
    if "NODE_RANK" in environ:  # mpirun's ranks share one environment: their node index is their NODE_RANK
        environ.setdefault("DTRAIN_NODE_INDEX", environ["NODE_RANK"])
    start_lease(environ)  # mpirun's nodes have no agent of ours: local rank 0 holds the node's lease
    environ.setdefault("PYTHONUNBUFFERED", "1")
    # A rank that dies in native code (an abort in a collective library, a segfault) prints
    # every thread's Python stack first, so its tail says where; a user's own setting wins.
    environ.setdefault("PYTHONFAULTHANDLER", "1")
    if environ.get("DTRAIN_DISTRIBUTION") == "tensorflow":
        from dtrain.launch.node.tf_config import tf_config_env  # TF scripts read TF_CONFIG unchanged

        environ.update(tf_config_env(environ))
    environ.update(deepspeed_launcher_env(environ))
    rank = RankProcess(rank_command(command, environ), environ)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, rank.forward)
    code = rank.run()
    ds_shm.release_rank(environ)
    rank.write_exit_record(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
