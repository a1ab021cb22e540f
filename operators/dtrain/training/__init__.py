"""What a training script imports: init from the env contract, checkpoint/resume, metrics, LR scaling,
a checkpoint on preemption (SIGTERM), and the epoch loop that ties them together (TrainLoop).

    from dtrain.training import init_distributed, CheckpointManager, MetricsWriter, PreemptionGuard, exit_now

Every name, with its signature and a complete script: docs/training.md.

Submodules import torch lazily, so importing this package stays cheap.
"""

from dtrain.training.checkpoint import CheckpointManager
from dtrain.training.collectives import CollectiveTimer, probe_links
from dtrain.training.data_position import ResumableSampler
from dtrain.training.dcp import ModelState
from dtrain.training.dist import DistContext, exit_now, init_distributed
from dtrain.training.loop import TrainLoop
from dtrain.training.metrics import MetricsWriter, write_result
from dtrain.training.preemption import STOP_EXIT_CODE, PreemptionGuard, StopRequest, stop_requested
from dtrain.training.scaling import scaled_lr, warmup_factor
from dtrain.training.watchdog import heartbeat

__all__ = [
    "CheckpointManager", "DistContext", "init_distributed", "exit_now", "MetricsWriter", "write_result", "TrainLoop",
    "scaled_lr", "warmup_factor", "heartbeat",
    "PreemptionGuard", "StopRequest", "stop_requested", "STOP_EXIT_CODE",
    "ModelState", "ResumableSampler", "CollectiveTimer", "probe_links",
]
