"""Per-rank entry point: ``python -m dtrain.launch.rank_entry CMD ARGS...``.

torchrun (or mpirun) starts this in place of the user's command, on every rank. It

* completes the env contract (NODE_RANK, and the OMPI_* mapping for mpirun);
* runs the command as an argv list (no shell), in this process group, and makes the
  kernel kill it if this wrapper dies (PR_SET_PDEATHSIG), so no rank outlives its agent;
* streams the command's stdout and stderr line by line, prefixed ``[nodeN rankR]``;
* writes an exit record (code, time, whether it was told to stop, last lines) into
  ``$DTRAIN_RUN_DIR/exits`` so the launcher can name the rank that failed first.

Stdlib only, and imported by nothing heavy: it is on every rank's start-up path.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

from dtrain.launch.env_contract import contract_from_env

TAIL_LINES = 40
PR_SET_PDEATHSIG = 1


def resolve_argv(command: list[str]) -> list[str]:
    """A ``.py`` script runs with this interpreter; a bare ``python`` means this interpreter too,
    so every rank uses the launcher's environment."""
    if command[0].endswith(".py"):
        return [sys.executable, *command]
    if command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class RankProcess:
    def __init__(self, command: list[str], environ: dict[str, str]):
        self.environ = environ
        self.prefix = f"[node{environ.get('NODE_RANK', '?')} rank{environ.get('RANK', '?')}] ".encode()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.tail_lock = threading.Lock()
        self.stop_signal: int | None = None
        self.proc = subprocess.Popen(
            resolve_argv(command), env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )

    def _pump(self, source, sink) -> None:
        for line in iter(source.readline, b""):
            with self.tail_lock:
                self.tail.append(line.decode(errors="replace").rstrip("\n"))
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
        code = self.proc.wait()
        for t in pumps:
            t.join(timeout=5)
        return 128 - code if code < 0 else code

    def write_exit_record(self, exit_code: int) -> None:
        run_dir = self.environ.get("DTRAIN_RUN_DIR")
        if not run_dir:
            return
        exits = os.path.join(run_dir, "exits")
        os.makedirs(exits, exist_ok=True)
        name = f"rank{self.environ.get('RANK', 'x')}.restart{self.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.json"
        record = {
            "rank": int(self.environ.get("RANK", -1)),
            "node_rank": int(self.environ.get("NODE_RANK", -1)),
            "local_rank": int(self.environ.get("LOCAL_RANK", -1)),
            "exit_code": exit_code,
            "stopped_by_signal": self.stop_signal,
            "time": time.time(),
            "host": os.uname().nodename,
            "tail": list(self.tail),
        }
        tmp = os.path.join(exits, f".{name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        os.replace(tmp, os.path.join(exits, name))


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("usage: python -m dtrain.launch.rank_entry CMD [ARGS...]", file=sys.stderr)
        return 2
    environ = dict(os.environ)
    environ.update(contract_from_env(environ, mpi_per_node_launch=environ.get("DTRAIN_MPI_PER_NODE") == "1"))
    environ.setdefault("PYTHONUNBUFFERED", "1")
    if environ.get("DTRAIN_DISTRIBUTION") == "tensorflow":
        from dtrain.launch.tf_config import tf_config_env  # TF scripts read TF_CONFIG unchanged

        environ.update(tf_config_env(environ))
    rank = RankProcess(command, environ)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, rank.forward)
    code = rank.run()
    rank.write_exit_record(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
