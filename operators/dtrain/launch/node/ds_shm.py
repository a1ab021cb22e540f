"""DeepSpeed's shared-memory all-reduce buffers, which DeepSpeed (0.19) never removes.

On a single node with the CPU accelerator (world size == LOCAL_SIZE), each rank creates
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (67 MB of RAM)
and nothing unlinks it (shm.cpp's ``shared_close`` is never called). Whoever outlives the ranks
removes the names once they have ended: the rank wrapper its rank's, the autotuner its
experiments'. Processes that still map a buffer keep their mapping; only the name goes.
Stdlib only: the rank wrapper imports it.
"""

from __future__ import annotations

import glob
import os
import stat

SHM_DIR = "/dev/shm"
PREFIX = "deepspeed_allreduce_buffer"


def buffer_name(addr: str, port: str, rank: str) -> str:
    return f"{PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def unlink_ours(path: str) -> bool:
    """Remove ``path`` if it is a regular file owned by us (never a symlink, never another user's)."""
    try:
        info = os.lstat(path)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
            os.unlink(path)
            return True
    except OSError:
        pass
    return False


def release_rank(environ: dict[str, str], shm_dir: str = SHM_DIR) -> None:
    """The buffer of the rank that ``environ`` describes (its MASTER_ADDR, MASTER_PORT and RANK)."""
    name = buffer_name(environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", ""), environ.get("RANK", ""))
    if "/" not in name:
        unlink_ours(os.path.join(shm_dir, name))


def release_ports(ports: list[int], shm_dir: str = SHM_DIR) -> int:
    """Every rank's buffer of the jobs that used these master ports (any address); how many went."""
    removed = 0
    for port in ports:
        pattern = os.path.join(glob.escape(shm_dir), f"{PREFIX}_{os.getuid()}_*_{int(port)}_*")
        removed += sum(unlink_ours(path) for path in glob.glob(pattern))
    return removed
