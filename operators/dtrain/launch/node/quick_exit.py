"""End a process that imported torch the moment its work is done, without the interpreter's teardown.

Once torch is imported, Python's own exit (clearing every module, then the garbage collector over
torch's objects) costs a few tenths of a second of CPU after the process's work has ended. Every
torchrun agent would pay it at the end of every job, on every node, between its workers' exit and
the launcher seeing the job end (``bench/launch.py`` times whole jobs). :func:`run_then_exit` runs a
``main`` as ``python -m`` would, with the same exit status and the same output, then ends the
process with :func:`os._exit`:

* ``main`` returning: status 0; ``sys.exit(n)``: ``n``; ``sys.exit("text")``: the text on stderr and
  status 1; any other exception: its traceback on stderr (``sys.excepthook``) and status 1;
* the ``atexit`` handlers run, as at the interpreter's exit (logging's shutdown, which flushes and
  closes its handlers; multiprocessing's removal of its temporary directory; torch's own), and
  stdout and stderr are flushed.

What is skipped is only what the operating system does anyway: freeing the process's memory, closing
its files and sockets, and ending its daemon threads. A non-daemon thread still running is ended too,
where the interpreter would wait for it: the agent's own work (its workers, its rendezvous, its log
directory) is over by then.

:func:`dtrain.training.dist.exit_now` is the ranks' counterpart (it flushes with :func:`flush_output`).
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn


def exit_status(code: object) -> int:
    """The process's exit status for ``sys.exit(code)``, as the interpreter computes it (a message
    other than an int is printed to stderr, and the status is 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run ``main()``; then flush, run the ``atexit`` handlers and end the process with its exit status."""
    try:
        main()
        status = 0
    except SystemExit as e:
        status = exit_status(e.code)
    except BaseException:  # noqa: BLE001 (reported as the interpreter reports it)
        sys.excepthook(*sys.exc_info())
        status = 1
    finish()
    os._exit(status)


def finish() -> None:
    """What the interpreter's exit does that matters once the work is done: the ``atexit`` handlers
    (logging's shutdown among them, when logging was imported), then :func:`flush_output`."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        flush_output()


def flush_output() -> None:
    """Flush stdout and stderr; one closed or replaced by then has nothing left to give."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (a closed or broken stream must not keep the process)
            pass
