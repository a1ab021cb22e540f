"""The ranks' exit records (``<run_dir>/exits/rank<R>.restart<N>.json``, written by
dtrain.launch.node.rank_entry as each rank ends): which ranks ended since a moment, and which rank
failed first.

No Airflow or torch import: the launcher, the backends and the Training tab's API all read
exit records.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from dtrain.rundir import EXIT_FILE, EXITS, MAX_RECORD_BYTES, run_dir_or_none

# Lines a rank prints when a collective or its transport broke (torch, gloo, NCCL spellings).
COMMUNICATION_ERRORS: tuple[str, ...] = (
    "Gloo connectFullMesh failed",
    "Connection reset by peer",
    "Connection closed by peer",
    "NCCL error",
    "ncclRemoteError",
    "ncclSystemError",
    "ncclInternalError",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "DistBackendError",
    "DistNetworkError",
    "Watchdog caught collective operation timeout",
)
# How far back in the tail to look: the error is among the rank's last lines.
TAIL_LINES_READ = 40
# A rank's line longer than this is cut before matching (matching stays cheap whatever it prints).
MAX_LINE_CHARS = 4096


def communication_error(tail: Sequence[str]) -> str | None:
    """The last line of ``tail`` that shows a gloo/NCCL communication error, if any."""
    for line in reversed(list(tail)[-TAIL_LINES_READ:]):
        text = str(line)[:MAX_LINE_CHARS]
        if any(pattern in text for pattern in COMMUNICATION_ERRORS):
            return text.strip()
    return None


def exit_records(run_dir: str) -> dict[str, int]:
    """The rank exit records now: file name -> mtime (ns). Regular files only (a directory or a
    link a rank planted in ``exits/`` is not a record)."""
    run = run_dir_or_none(run_dir)
    if run is None:
        return {}
    return {entry.name: entry.mtime_ns for entry in run.list(EXITS)
            if not entry.is_dir and EXIT_FILE.match(entry.name)}


def ranks_exited_since(before: dict[str, int], now: dict[str, int], world_size: int) -> bool:
    """Whether every rank wrote an exit record since ``before`` (a new file, or one rewritten)."""
    ranks = {name.split(".", 1)[0] for name, mtime in now.items() if before.get(name) != mtime}
    return len(ranks) >= world_size


def records_since(run_dir: str, before: dict[str, int], now: dict[str, int]) -> list[dict[str, Any]]:
    """The records written since ``before`` (``now`` from :func:`exit_records`), parsed; a record
    that cannot be read (half-written, too large, not JSON, a link) is skipped."""
    run = run_dir_or_none(run_dir)
    out = []
    for name, mtime in sorted(now.items()):
        if before.get(name) == mtime or run is None:
            continue
        record = run.read_json(EXITS, name, limit=MAX_RECORD_BYTES)
        if isinstance(record, dict):
            out.append(record)
    return out


def first_failure(run_dir: str) -> dict[str, Any] | None:
    """The record of the rank that failed first on its own among those in ``run_dir`` now."""
    return first_failure_of(records_since(run_dir, {}, exit_records(run_dir)))


def first_failure_of(records: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The record of the rank that failed first on its own: a nonzero exit not caused by a stop
    signal from its agent or from us (those ranks were taken down by the failure, not its cause).

    A rank whose last lines show a broken collective ("Connection closed by peer"...) failed
    because a peer went away, so a rank without such lines is named before it whatever the
    times say: the two exits are milliseconds apart and the order their wrappers see them in
    is the scheduler's. Only when every failed rank shows one (a network fault) is the earliest
    of them named."""
    failed = [r for r in records if r.get("exit_code") and not r.get("stopped_by_signal")
              and isinstance(r.get("time"), (int, float))]
    if not failed:
        return None
    return min(failed, key=lambda r: (lost_a_peer(r), r["time"]))


def lost_a_peer(record: dict[str, Any]) -> bool:
    """Whether the rank's last lines show a gloo/NCCL communication error."""
    tail = record.get("tail")
    return communication_error(tail if isinstance(tail, list) else []) is not None
