"""The rank's side of hang detection (the files: :mod:`dtrain.launch.node.hang_files`; the watcher
that reads them: :mod:`dtrain.launch.engine.hang`).

* :func:`heartbeat`: tell the launcher this rank is making progress when it neither
  prints nor writes metrics for a while (a long evaluation, a slow first batch).
* :func:`start_dump_responder`: a daemon thread, started by ``init_distributed`` when the
  launcher watches for hangs, that answers a dump request with this process's Python
  stacks (every thread) and torch's flight recorder.

Why a thread in the rank rather than an outside tool: a thread needs no ptrace rights
(containers often lack CAP_SYS_PTRACE), it can read the flight recorder, which lives in
the process, and it runs while the main thread is blocked in a collective (gloo and NCCL
waits release the GIL). Scripts that do not use the helper are dumped by their wrapper with
py-spy when it is installed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

from dtrain.launch.node.hang_files import (
    HANG_DIR_ENV, ProgressToucher, exists, flight_recorder_path, progress_dir, request_path, stack_path, write_private,
)

_toucher: ProgressToucher | None = None
_responder: threading.Thread | None = None


def heartbeat() -> None:
    """Mark this rank as alive and progressing (cheap: one file touch a second at most)."""
    global _toucher
    run_dir = os.environ.get("DTRAIN_RUN_DIR")
    if not run_dir:
        return
    if _toucher is None:
        _toucher = ProgressToucher(progress_dir(run_dir), os.environ.get("RANK", "0"))
    _toucher.touch()


def format_stacks() -> str:
    """Every thread's Python stack, the main thread first."""
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    lines = [f"# pid {os.getpid()}, rank {os.environ.get('RANK', '?')}, {time.strftime('%Y-%m-%dT%H:%M:%S')}"]
    for ident in sorted(frames, key=lambda i: (i != main, i)):
        thread = threads.get(ident)
        name = thread.name if thread else "unknown"
        lines.append(f"\nThread {name} (id {ident}){' [main]' if ident == main else ''}:")
        lines.extend(line.rstrip("\n") for line in traceback.format_stack(frames[ident]))
    return "\n".join(lines) + "\n"


def flight_recorder_json() -> bytes | None:
    """torch's flight recorder (the collectives this rank entered) as JSON, when recording."""
    torch = sys.modules.get("torch")  # never import torch here: only a rank that uses it has a recorder
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        return _dump_fr_trace_json(includeCollectives=True, onlyActive=False)
    except Exception as e:  # noqa: BLE001 - a private API: its absence must not break the dump
        return json.dumps({"error": str(e)[:200]}).encode()


def answer_dump_request(directory: str, rank: str) -> None:
    recorder = flight_recorder_json()
    if recorder is not None:
        write_private(flight_recorder_path(directory, rank), recorder)
    write_private(stack_path(directory, rank), format_stacks().encode())


def _respond(directory: str, rank: str, interval: float) -> None:
    # The launcher removes an earlier attempt's request before the job starts: one that
    # exists now is for this job.
    request = request_path(directory)
    while not exists(request):
        time.sleep(interval)
    try:
        answer_dump_request(directory, rank)
    except OSError as e:
        print(f"[dtrain] could not write the stack dump: {e}", file=sys.stderr)


def start_dump_responder(interval: float = 0.5) -> bool:
    """Start the thread that answers the launcher's dump request (once per process); False when
    the launcher is not watching for hangs."""
    global _responder
    directory = os.environ.get(HANG_DIR_ENV)
    if not directory or _responder is not None:
        return False
    _responder = threading.Thread(target=_respond, name="dtrain-hang-dump", daemon=True,
                                  args=(directory, os.environ.get("RANK", "0"), interval))
    _responder.start()
    return True
