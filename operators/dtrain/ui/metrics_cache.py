"""The Training tab's view of a run's metrics: one bounded copy per run directory, followed from
where the last refresh stopped, and what is drawn from it computed once per change.

A page refreshes every 2 s and asks for the summary, three plots and the log tails, all from the
same per-rank metrics files (``metrics/rank<R>.jsonl``), which the ranks (untrusted) keep
appending to. So, per run directory:

* each rank file is read from the offset the previous refresh reached; a replaced or truncated
  file (another inode, a smaller size) is read again from its end;
* the bytes read in one refresh, across all ranks, are at most :data:`MAX_RUN_BYTES` (each rank
  gets an equal share; a file that grew by more is read from its end, the skipped records are
  not drawn), and the records kept at most :data:`MAX_RUN_RECORDS` (each rank its share, newest
  kept);
* a record keeps only the fields the tab draws (:data:`FIELDS`), each a finite number of at
  most :data:`dtrain.curves.MAX_VALUE`, its step an integer in [0, 2**53) (what a browser and matplotlib can
  hold): a rank's ``1e308`` or ``10**400`` is dropped here, once, not in every view;
* what is computed from the records (the curves, each plot) is kept until they change
  (:meth:`RunMetrics.once`), so one refresh computes the curves once however many views use them.

At most :data:`MAX_RUNS` run directories are kept, the least recently watched dropped first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from dtrain.curves import number
from dtrain.rundir import METRICS, METRICS_FILE, Entry, RunDir

#: bytes read from one run's rank files in one refresh, all ranks together
MAX_RUN_BYTES = 8 * 1024 * 1024
#: records kept for one run, all ranks together (curves show at most 2000 points a rank anyway)
MAX_RUN_RECORDS = 20_000
#: run directories whose metrics are kept
MAX_RUNS = 4
#: the fields of a metrics record (dtrain.training.metrics) the tab uses: curves and stall report
FIELDS = ("loss", "samples", "samples_per_s", "step_time_s", "data_wait_s", "compute_time_s", "comm_wait_s", "node")
#: steps beyond this lose precision in a browser and do not convert to a float
MAX_STEP = 2**53 - 1


def parse(line: bytes) -> dict[str, Any] | None:
    """One metrics line as the tab keeps it (see the module docstring); None: not a record."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # a cut line, garbage, 5000 digits, [[[[... a million deep
        return None
    if not isinstance(record, dict):
        return None
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        return None
    kept = {"step": step}
    for name in FIELDS:
        value = number(record.get(name))
        if value is not None:
            kept[name] = value
    return kept


@dataclass
class _RankFile:
    """Where the reading of one rank's file stands."""

    name: str
    ino: int
    offset: int = 0
    #: the start of a line whose end is not written yet
    pending: bytes = b""
    #: the next bytes continue a line cut by a skip: dropped up to the next newline
    cut: bool = False
    records: list[dict[str, Any]] = field(default_factory=list)

    def follow(self, run: RunDir, size: int, budget: int, keep: int) -> tuple[int, bool]:
        """Read what was appended since the last call, at most ``budget`` bytes (the newest when
        more); keep the newest ``keep`` records. Returns (bytes read, whether records changed)."""
        start = self.offset
        if size - start > budget:
            start, self.pending, self.cut = size - budget, b"", True
        got = run.read_from(METRICS, self.name, offset=start, limit=budget)
        if got is None:
            return 0, False
        data = got[0]
        read = len(data)
        self.offset = start + read
        if self.cut:
            newline = data.find(b"\n")
            data, self.cut = (b"", True) if newline < 0 else (data[newline + 1:], False)
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        if len(self.pending) > budget:  # a line longer than a refresh may read: no record of ours
            self.pending, self.cut = b"", True
        added = [record for record in map(parse, lines) if record is not None]
        self.records.extend(added)
        trimmed = self.trim(keep)
        return read, bool(added) or trimmed

    def trim(self, keep: int) -> bool:
        if len(self.records) <= keep:
            return False
        del self.records[:len(self.records) - keep]
        return True


class RunMetrics:
    """One run directory's metrics records, followed (see the module docstring). Thread-safe: the
    page's requests arrive together."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.RLock()  # a plot computed under once() asks once() for the curves
        self.files: dict[int, _RankFile] = {}
        #: rank -> its records, oldest first: a snapshot replaced (never changed) when they change
        self.records: Mapping[int, tuple[dict[str, Any], ...]] = {}
        #: bumped whenever :attr:`records` changes; what :meth:`once` computed is kept for one version
        self.version = 0
        #: bytes the last refresh read (all ranks), and all refreshes together
        self.last_read = 0
        self.total_read = 0
        self._computed: dict[Any, Any] = {}

    def refresh(self, run: RunDir) -> None:
        """Read what the ranks appended since the last refresh, within the bounds."""
        with self.lock:
            entries = run.ranked(METRICS, METRICS_FILE)
            changed = self._forget(entries)
            share = max(1, len(entries))
            budget, keep = MAX_RUN_BYTES // share, MAX_RUN_RECORDS // share
            self.last_read = 0
            for rank, entry in sorted(entries.items()):
                rank_file = self.files.get(rank)
                if rank_file is None or rank_file.ino != entry.ino or entry.size < rank_file.offset:
                    rank_file = self.files[rank] = _RankFile(entry.name, entry.ino)
                    changed = True
                read, grew = rank_file.follow(run, entry.size, budget, keep) if entry.size > rank_file.offset \
                    else (0, rank_file.trim(keep))
                self.last_read += read
                changed = changed or grew
            self.total_read += self.last_read
            if changed:
                self.records = {rank: tuple(f.records) for rank, f in sorted(self.files.items()) if f.records}
                self.version += 1
                self._computed = {}

    def _forget(self, entries: Mapping[int, Entry]) -> bool:
        gone = [rank for rank in self.files if rank not in entries]
        for rank in gone:
            del self.files[rank]
        return bool(gone)

    def once(self, key: Any, compute: Callable[[Mapping[int, tuple[dict[str, Any], ...]]], Any]) -> Any:
        """``compute(records)``, computed once per version of the records (under ``key``)."""
        with self.lock:
            if key not in self._computed:
                self._computed[key] = compute(self.records)
            return self._computed[key]


_RUNS: OrderedDict[str, RunMetrics] = OrderedDict()
_RUNS_LOCK = threading.Lock()


def follow(run: RunDir) -> RunMetrics:
    """The run directory's metrics, refreshed: the one copy kept for it (made on first use)."""
    with _RUNS_LOCK:
        metrics = _RUNS.pop(run.path, None) or RunMetrics(run.path)
        _RUNS[run.path] = metrics  # the most recently watched last
        while len(_RUNS) > MAX_RUNS:
            _RUNS.popitem(last=False)
    metrics.refresh(run)
    return metrics


def cached() -> dict[str, RunMetrics]:
    """The run directories whose metrics are kept now (for tests and the benchmark)."""
    with _RUNS_LOCK:
        return dict(_RUNS)
