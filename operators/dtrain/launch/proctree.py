"""Stop a whole process tree on this host: SIGTERM every descendant, then SIGKILL what is left.

Descendants are signalled one by one rather than by process group, because torchrun gives
each worker a session of its own. Used on remote hosts by the SSH agents.
"""

from __future__ import annotations

import signal


def kill_tree(root, grace: float) -> None:
    """``root`` is a psutil.Process; it is not signalled itself, only its descendants."""
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
        _, alive = psutil.wait_procs(victims, timeout=grace if attempt == 0 else 2.0)
        if attempt == 1:
            for proc in alive:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
