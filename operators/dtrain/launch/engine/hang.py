"""Hang detection: which rank stopped making progress, every rank's stack, then a diagnosis.

A rank makes progress while it prints a line (its per-rank wrapper touches
``<run_dir>/progress/rank<R>``, at most once a second), writes a metrics record
(``<run_dir>/metrics/rank<R>.jsonl``) or calls :func:`dtrain.training.heartbeat`
(which touches the progress file). Its start (``progress/rank<R>.started``, touched by the
wrapper) is not progress: until a rank's first sign of progress after it (re)started, it is
silent only after ``max(hang_timeout, STARTUP_S)`` seconds, as importing torch and joining the
process group print nothing. Everything goes through files in the run
directory, which every backend already shares with the launcher (checkpoints and
exit records live there too), so one watcher serves every backend.

When any rank has been silent for ``hang_timeout`` seconds -- the whole job
stalled, or one rank stuck while others wait for it or run ahead -- :func:`hang_sequence`
(driven by :class:`HangWatch`, a thread beside the launcher, or by the deferrable trigger's loop)

1. writes ``<run_dir>/hang/request``; each rank answers by writing its stack to
   ``hang/rank<R>.txt`` (a thread that :func:`dtrain.training.init_distributed`
   started, which also writes torch's flight recorder to ``hang/rank<R>.fr.json``;
   for a script that does not use the helper, the per-rank wrapper runs
   ``py-spy dump`` when it is installed, or says why there is no stack);
2. names the stuck rank(s): from the flight recorder, the ranks that never entered
   the newest collective their peers wait in; without it, from the stacks, the ranks
   whose main thread is not waiting in a collective; failing both, the ranks silent longest;
3. hands a :class:`HangVerdict` to its driver, which tears the job down; the task fails with
   :data:`HANG_EXIT_CODE`.

The ranks' side of the exchange (where they mark progress, where they find the request and write
their stacks) is :mod:`dtrain.launch.node.hang_files`: the per-rank wrapper and the training
helper import that module, never this one. This one is the watcher's (the launcher, the
deferrable trigger). Stdlib only.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Generator

from dtrain.launch.node.hang_files import (
    HANG_DIR_ENV, MAX_STACK_CHARS, flight_recorder_path, hang_dir, request_path, stack_path, started_name,
    write_private,
)
from dtrain.rundir import HANG, METRICS, PROGRESS, STACK_FILE, RunDir, UnsafeRunDir, run_dir_or_none

#: exit code of a launch torn down because it hung (as timeout(1) reports a command it stopped)
HANG_EXIT_CODE = 124
#: how long the watcher waits for the ranks' stack dumps before it gives up on the missing ones
DUMP_WAIT_S = 20.0
#: flight recorder entries kept per process group when hang detection is on
FLIGHT_RECORDER_ENTRIES = "2000"
#: ranks whose last progress is within this many seconds of the oldest count as silent longest
SILENCE_TIE_S = 2.0
#: a flight recorder dump larger than this is not read (a rank's files are untrusted input)
MAX_RECORDER_BYTES = 32 * 1024 * 1024


def rank_env(run_dir: str, environ: dict[str, str]) -> dict[str, str]:
    """What every rank gets when hang detection is on: where to answer a dump request, where
    to record progress, and a flight recorder (gloo and NCCL; NCCL also dumps on its own
    watchdog timeout). A value the user set is kept.

    ``TORCH_FR_BUFFER_SIZE`` sizes the recorder of both backends; its old name
    ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is not set: torch 2.13 prints a deprecation warning for it on
    every rank, even on CPU (older torch releases read only the old name for NCCL: set it with ``--env``
    there, docs/hangs.md)."""
    directory = hang_dir(run_dir)
    env = {
        HANG_DIR_ENV: directory,
        "TORCH_FR_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": os.path.join(directory, "nccl_trace_rank_"),
    }
    return {name: value for name, value in env.items() if name not in environ}


def read_bounded(path: str, limit: int) -> bytes | None:
    """A rank-written file's bytes, or None when it is missing, a symlink (the file or its
    directory), not a regular file, or over ``limit``."""
    try:
        return RunDir(os.path.dirname(path)).read(os.path.basename(path), limit=limit)
    except UnsafeRunDir:
        return None


#: a rank that has shown no progress since its wrapper (re)started it is judged against at least this
#: many seconds, not hang_timeout: importing torch (and DeepSpeed) and joining the process group print
#: nothing, and on a loaded host or from a shared filesystem take longer than a short hang_timeout. A
#: job whose ranks hang before their first line is still caught, after this long.
STARTUP_S = 120.0


def last_progress(run_dir: str, rank: int) -> float | None:
    """Wall-clock time of the rank's latest sign of progress, None when it has shown none.

    The status-change time (ctime), not the modification time: any process of the job can set a
    file's mtime to the past (``os.utime``) and so get another rank blamed for a hang, but the
    kernel sets ctime to now on every change, that one included."""
    return _latest(run_dir_or_none(run_dir), (PROGRESS, f"rank{rank}"), (METRICS, f"rank{rank}.jsonl"))


def last_start(run_dir: str, rank: int) -> float | None:
    """When the rank's wrapper last (re)started it (a ctime, as :func:`last_progress`), None before."""
    return _latest(run_dir_or_none(run_dir), (PROGRESS, started_name(rank)))


def _latest(run: RunDir | None, *files: tuple[str, str]) -> float | None:
    latest = None
    for parts in files:
        info = run.stat(*parts) if run is not None else None
        if info is None or not stat.S_ISREG(info.st_mode):
            continue
        latest = info.st_ctime if latest is None else max(latest, info.st_ctime)
    return latest


@dataclass(frozen=True)
class JobProgress:
    """Each rank's latest sign of life (``last``), and the ranks still starting: no progress since
    their wrapper (re)started them (their sign is that start), or not started while others are."""

    last: dict[int, float] = field(default_factory=dict)
    starting: frozenset[int] = frozenset()

    def silent(self, now: float, timeout: float) -> list[int]:
        """Ranks silent for ``timeout`` seconds, a starting rank for ``max(timeout, STARTUP_S)``."""
        startup = max(timeout, STARTUP_S)
        return sorted(rank for rank, when in self.last.items()
                      if now - when >= (startup if rank in self.starting else timeout))


def job_progress(run_dir: str, world_size: int, since: float) -> JobProgress:
    """Each rank's last sign of life, once the job runs; nothing before any rank of it has started.

    Signs older than ``since`` are an earlier attempt's. Until the first rank starts (its
    wrapper marks it at once), the job is queued or its agents are still meeting, which is not
    a hang: a queued Slurm job may wait for hours, and rendezvous has its own timeout. From
    then on, a rank that never showed a sign of life is starting since the first one started,
    and a rank whose latest sign is its (re)start is starting since then.
    """
    def fresh(when: float | None) -> float | None:
        return when if when is not None and when >= since else None

    progress = {rank: fresh(last_progress(run_dir, rank)) for rank in range(world_size)}
    starts = {rank: fresh(last_start(run_dir, rank)) for rank in range(world_size)}
    signs = [when for when in (*progress.values(), *starts.values()) if when is not None]
    if not signs:
        return JobProgress()
    job_started = min(signs)
    last, starting = {}, set()
    for rank in range(world_size):
        made, began = progress[rank], starts[rank]
        if made is not None and (began is None or made >= began):
            last[rank] = made
        else:
            last[rank] = began if began is not None else job_started
            starting.add(rank)
    return JobProgress(last, frozenset(starting))


def newest_collective(flight_recorder: dict[str, Any]) -> tuple[int, str] | None:
    """(sequence id, name) of the newest collective a rank entered on its default process
    group, from torch's flight recorder dump (``_dump_fr_trace_json``)."""
    best: tuple[int, str] | None = None
    for entry in flight_recorder.get("entries") or ():
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue
        group = entry.get("process_group") or ["", ""]
        if str(entry.get("pg_id", group[0])) not in ("0",):
            continue
        seq = entry.get("collective_seq_id")
        if isinstance(seq, int) and (best is None or seq > best[0]):
            best = (seq, printable(entry.get("profiling_name") or "collective"))
    return best


def printable(value: Any, limit: int = 80) -> str:
    """A rank-written name fit for a log line: printable ASCII, bounded."""
    text = "".join(ch if " " <= ch <= "~" else "?" for ch in str(value))
    return text[:limit]


@dataclass
class HangVerdict:
    """What the launcher reports when a job hung (primitives only: it goes to XCom)."""

    stuck_ranks: list[int]
    silent_s: dict[str, float]
    timeout_s: float
    reason: str
    stacks: dict[str, str] = field(default_factory=dict)
    flight_recorder: dict[str, str] = field(default_factory=dict)
    missing_stacks: list[int] = field(default_factory=list)
    detected_after_s: float = 0.0
    detected_at: float = 0.0

    def message(self) -> str:
        ranks = ", ".join(str(r) for r in self.stuck_ranks)
        paths = ", ".join(self.stacks[k] for k in sorted(self.stacks, key=int)) or "none written"
        return (f"hang detected: rank(s) {ranks} stuck ({self.reason}); no progress for "
                f"{self.timeout_s:g} s (hang_timeout); stack dumps: {paths}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Frames of a main thread that waits for its peers: a torch.distributed collective, DDP's
# gradient all-reduce inside backward, DeepSpeed's communication layer.
WAITING_FRAMES = ("distributed_c10d.py", "torch/nn/parallel/distributed.py", "_engine_run_backward",
                  "deepspeed/comm/")


def main_thread_stack(text: str) -> str:
    """The main thread's part of a stack dump (the helper's format or py-spy's)."""
    for marker in ("[main]:", '"MainThread"'):
        start = text.find(marker)
        if start >= 0:
            end = text.find("\nThread ", start)
            return text[start:] if end < 0 else text[start:end]
    return text


def waiting_in_collective(stack: str) -> bool:
    main = main_thread_stack(stack)
    return any(frame in main for frame in WAITING_FRAMES)


def diagnose(last: dict[int, float], now: float, timeout: float, recorders: dict[int, dict[str, Any]],
             stacks: dict[int, str] | None = None) -> tuple[list[int], str]:
    """Name the stuck rank(s) and say why. The flight recorder is the better witness: a rank
    that never entered the collective its peers are blocked in is the one holding them up.
    Next, the stacks: ranks whose main thread is not waiting in a collective while others are.
    Failing both, the rank(s) silent longest."""
    stacks = stacks or {}
    newest = {rank: newest_collective(fr) for rank, fr in recorders.items()}
    known = {rank: seq for rank, seq in newest.items() if seq is not None}
    if len(known) == len(last) and len(known) > 1:
        top_seq, top_name = max(known.values())
        behind = sorted(rank for rank, (seq, _) in known.items() if seq < top_seq)
        if behind:
            waiting = sorted(set(known) - set(behind))
            return behind, (f"never entered collective #{top_seq} ({top_name}) that rank(s) "
                            f"{', '.join(map(str, waiting))} wait in")
    if len(stacks) == len(last) and len(stacks) > 1:
        waiting = sorted(rank for rank, text in stacks.items() if waiting_in_collective(text))
        if waiting and len(waiting) < len(stacks):
            return sorted(set(stacks) - set(waiting)), (f"not in a collective, while rank(s) "
                                                         f"{', '.join(map(str, waiting))} wait in one")
    oldest = min(last.values())
    stuck = sorted(rank for rank, when in last.items() if when - oldest <= SILENCE_TIE_S)
    if len(stuck) == len(last):
        return stuck, "no rank made progress"
    return stuck, "silent the longest while other ranks went on"


def clear_previous(run_dir: str) -> None:
    """An earlier attempt's request would make new ranks dump at once, and its stacks would pass
    for this attempt's: remove them before the job starts. A ``hang`` that a rank replaced by a
    link or a file is removed, never followed, and made again (:meth:`RunDir.clear`)."""
    RunDir(run_dir).clear(HANG)


class HangDetector:
    """The steps of hang detection, without a thread or an event loop of its own, so the
    launcher's watch thread and the deferrable trigger's async loop share them.

    Args:
        run_dir: the job's run directory (shared with every node).
        world_size: ranks to watch, 0..world_size-1.
        timeout: seconds of silence that make a hang.
        since: when the job started (a rank without progress yet is silent since then).
    """

    def __init__(self, run_dir: str, world_size: int, timeout: float, since: float):
        self.run_dir = run_dir
        self.directory = hang_dir(run_dir)
        self.world_size = world_size
        self.timeout = timeout
        self.since = since

    def clear_previous(self) -> None:
        clear_previous(self.run_dir)

    def progress(self) -> JobProgress:
        return job_progress(self.run_dir, self.world_size, self.since)

    def silent(self, progress: JobProgress, now: float) -> list[int]:
        return progress.silent(now, self.timeout)

    def request_dumps(self) -> bool:
        """Ask every rank for its stack; False when the request cannot be written (a rank removed or
        replaced the hang directory...): the verdict then goes on without the stacks."""
        try:
            write_private(request_path(self.directory), json.dumps({"time": time.time()}).encode())
            return True
        except (OSError, ValueError):
            return False

    def dumped(self) -> set[int]:
        run = run_dir_or_none(self.run_dir)
        ranks = run.ranked(HANG, STACK_FILE) if run is not None else {}
        return {r for r in ranks if r < self.world_size}

    def verdict(self, last: dict[int, float], now: float) -> HangVerdict:
        """Read the dumps, name the stuck rank(s), and record the verdict next to the stacks."""
        stacks = self.dumped()
        recorders = self._read_recorders()
        stuck, reason = diagnose(last, now, self.timeout, recorders, self._read_stacks(stacks))
        verdict = HangVerdict(
            stuck_ranks=stuck, silent_s={str(rank): round(now - when, 1) for rank, when in last.items()},
            timeout_s=self.timeout, reason=reason,
            stacks={str(r): stack_path(self.directory, r) for r in sorted(stacks)},
            flight_recorder={str(r): flight_recorder_path(self.directory, r) for r in sorted(recorders)},
            missing_stacks=sorted(set(range(self.world_size)) - stacks),
            detected_after_s=round(now - min(last.values()), 1), detected_at=now,
        )
        try:
            write_private(os.path.join(self.directory, "verdict.json"), json.dumps(verdict.to_dict(), indent=2).encode())
        except (OSError, ValueError):
            pass  # the verdict still goes to the log and XCom
        return verdict

    def _read_stacks(self, ranks: set[int]) -> dict[int, str]:
        texts = {}
        for rank in ranks:
            raw = read_bounded(stack_path(self.directory, rank), MAX_STACK_CHARS * 2)
            if raw is not None:
                texts[rank] = raw.decode(errors="replace")
        return texts

    def _read_recorders(self) -> dict[int, dict[str, Any]]:
        recorders = {}
        for rank in range(self.world_size):
            raw = read_bounded(flight_recorder_path(self.directory, rank), MAX_RECORDER_BYTES)
            try:
                data = json.loads(raw) if raw is not None else None
            except ValueError:
                continue
            if isinstance(data, dict):
                recorders[rank] = data
        return recorders


#: how often the drivers look for the ranks' stack dumps while they wait for them
DUMP_CHECK_S = 0.2


def hang_sequence(detector: "HangDetector", say: Callable[[str, str], Any],
                  dump_wait: float) -> Generator[float, None, "HangVerdict | None"]:
    """One look for a hang, and what follows one: which rank is silent, every rank asked for its stack,
    the dumps awaited (at most ``dump_wait`` s), the verdict. The one copy of this sequence for both its
    drivers, :class:`HangWatch` (a thread) and the deferrable trigger (a coroutine): it yields the seconds
    to wait before it looks at the dumps again, each driver waiting its own way, and returns the verdict
    (None while no rank is silent). ``say(level, message)``: "warning" or "error"."""
    progress, now = detector.progress(), time.time()
    silent = detector.silent(progress, now)
    if not silent:
        return None
    starting = sorted(set(silent) & progress.starting)
    startup = (f" (rank(s) {starting} silent since they started, {max(detector.timeout, STARTUP_S):g} s)"
               if starting else "")
    say("warning", f"no progress from rank(s) {silent} for {detector.timeout:g} s{startup}: "
                   "asking every rank for its stack")
    if detector.request_dumps():
        deadline = time.monotonic() + dump_wait
        while len(detector.dumped()) < detector.world_size and time.monotonic() < deadline:
            yield DUMP_CHECK_S
    else:
        say("warning", "the stack-dump request could not be written to the run directory: "
                       "deciding without the stacks")
    verdict = detector.verdict(progress.last, now)
    say("error", verdict.message())
    return verdict


def poll_interval(timeout: float) -> float:
    """How often to look at the progress files: a tenth of the timeout, 0.2 to 5 s."""
    return max(0.2, min(5.0, timeout / 10))


class HangWatch:
    """A daemon thread next to whatever waits for the job (the launcher): on a hang it collects
    every rank's stack, then calls ``on_hang`` with the :class:`HangVerdict`; ``on_hang`` must
    tear the job down.

    Args:
        run_dir, world_size, timeout: as :class:`HangDetector`.
        on_hang: called once, from the watch thread, with the verdict.
        sink: where the diagnosis is logged.
        dump_wait: seconds to wait for every rank's stack dump.
    """

    def __init__(self, run_dir: str, world_size: int, timeout: float, on_hang: Callable[[HangVerdict], None],
                 sink: Callable[[str], None] = print, dump_wait: float = DUMP_WAIT_S, interval: float | None = None):
        self.detector = HangDetector(run_dir, world_size, timeout, since=time.time())
        self.on_hang = on_hang
        self.sink = sink
        self.dump_wait = dump_wait
        self.interval = interval if interval is not None else poll_interval(timeout)
        self.verdict: HangVerdict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "HangWatch":
        self.detector.since = time.time() - 1  # file systems with whole-second mtimes
        self.detector.clear_previous()
        self._thread = threading.Thread(target=self._run, name="dtrain-hang-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.dump_wait + 10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if self._check():
                    return
            except Exception as e:  # a rank's files must never end the watch: hangs are still enforced
                self.sink(f"[dtrain] hang watch: {type(e).__name__}: {e} (still watching)")

    def _check(self) -> bool:
        """One look at the progress files; True once a verdict was handed over (or the watch stopped)."""
        sequence = hang_sequence(self.detector, lambda level, message: self.sink(f"[dtrain] {message}"),
                                 self.dump_wait)
        try:
            while True:
                if self._stop.wait(next(sequence)):
                    return True
        except StopIteration as ended:
            self.verdict = ended.value
        if self.verdict is None:
            return False
        if not self._stop.is_set():
            self.on_hang(self.verdict)
        return True
