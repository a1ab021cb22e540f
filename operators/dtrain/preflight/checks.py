"""What one node checks about itself before training. Stdlib only: it runs on every node
(``python -m dtrain.preflight.node``), locally or over SSH.

* the staged dataset's manifest is visible here and is the one the staging step wrote;
* there is free disk for checkpoints;
* the GPU count covers procs_per_node when GPUs are expected;
* the interface this node reaches node 0 (MASTER_ADDR) through: the one its ranks will use
  (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: dtrain.launch.node.netif); no route is a problem;
* NCCL's InfiniBand settings, as the AzureML guide advises: InfiniBand devices present -> keep IB
  enabled on them; none -> disable IB.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
from typing import Any

IB_CLASS = "/sys/class/infiniband"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def infiniband_devices(root: str = IB_CLASS) -> list[str]:
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


def nccl_env(ib_devices: list[str]) -> dict[str, str]:
    """NCCL's InfiniBand settings for a node with ``ib_devices``. The socket interface is not one of
    them: it can differ between nodes, and each node's rank wrapper sets its own."""
    if ib_devices:
        return {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": ",".join(ib_devices)}
    return {"NCCL_IB_DISABLE": "1"}


#: what the training task takes from preflight's XCom, each with the grammar of its value (device and
#: interface names). NCCL_SOCKET_IFNAME is no longer recommended (see nccl_env) but still accepted, as
#: a run's XCom written by an earlier release holds it.
NCCL_ENV_GRAMMAR = {
    "NCCL_IB_DISABLE": re.compile(r"[01]"),
    "NCCL_IB_HCA": re.compile(r"[A-Za-z0-9_.:-]{1,64}(,[A-Za-z0-9_.:-]{1,64}){0,63}"),
    "NCCL_SOCKET_IFNAME": re.compile(r"[A-Za-z0-9_.:@-]{1,64}"),
}


def checked_nccl_env(value: Any) -> dict[str, str]:
    """A recommendation as preflight's XCom carries it to the training task, checked: that XCom can be
    PATCHed by anyone who may edit the DAG, and the ranks would run with it (an ``LD_PRELOAD`` there
    runs their code in every rank). Only :func:`nccl_env`'s variables, with values of their grammar;
    anything else is a :class:`~dtrain.errors.SpecError` naming the key or value."""
    from dtrain.errors import SpecError

    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError("preflight nccl_env", value, "a mapping of NCCL variable to value")
    out = {}
    for key, item in value.items():
        grammar = NCCL_ENV_GRAMMAR.get(key)
        if grammar is None:
            raise SpecError("preflight nccl_env", key, f"one of {', '.join(NCCL_ENV_GRAMMAR)} (what preflight sets)")
        if not isinstance(item, str) or grammar.fullmatch(item) is None:
            raise SpecError(f"preflight nccl_env[{key!r}]", item, f"text matching {grammar.pattern}")
        out[key] = item
    return out


def gpu_count() -> int:
    from dtrain.launch.backends.placement import visible_gpu_count

    return visible_gpu_count()


def check_node(*, manifest_path: str | None = None, manifest_sha256: str | None = None,
               checkpoint_dir: str | None = None, min_free_gb: float = 1.0, expect_gpus: bool = False,
               procs_per_node: int = 1, master_addr: str | None = None) -> dict[str, Any]:
    """Run every check on this node; return facts and the list of problems (empty = ready)."""
    problems: list[str] = []
    facts: dict[str, Any] = {"host": socket.gethostname()}
    if manifest_path:
        if not os.path.isfile(manifest_path):
            problems.append(f"staged manifest not visible at {manifest_path}")
        else:
            sha = file_sha256(manifest_path)
            facts["manifest_sha256"] = sha
            if manifest_sha256 and sha != manifest_sha256:
                problems.append(f"staged manifest {manifest_path} differs from the one staging wrote "
                                f"(sha256 {sha[:12]} != {manifest_sha256[:12]})")
    if checkpoint_dir:
        probe = checkpoint_dir
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        free_gb = shutil.disk_usage(probe or "/").free / 2**30
        facts["free_gb"] = round(free_gb, 1)
        if free_gb < min_free_gb:
            problems.append(f"only {free_gb:.1f} GiB free for checkpoints under {checkpoint_dir}, need {min_free_gb}")
    gpus = gpu_count()
    facts["gpus"] = gpus
    if expect_gpus and gpus < procs_per_node:
        problems.append(f"{gpus} GPU(s) visible, procs_per_node={procs_per_node} needs one each")
    if master_addr:
        from dtrain.launch.node.netif import interface_to

        interface = interface_to(master_addr)
        facts["socket_ifname"] = interface
        if interface is None:
            problems.append(f"no route from this node to node 0 at {master_addr} (MASTER_ADDR): "
                            f"the ranks could not rendezvous")
    ib = infiniband_devices()
    facts["infiniband"] = ib
    facts["nccl_env"] = nccl_env(ib)
    return {"ok": not problems, "problems": problems, "facts": facts}
