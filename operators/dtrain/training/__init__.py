"""What a training script imports: init from the env contract, checkpoint/resume, metrics, LR scaling.

    from dtrain.training import init_distributed, CheckpointManager, MetricsWriter, scaled_lr

Submodules import torch lazily, so importing this package stays cheap.
"""

from dtrain.training.checkpoint import CheckpointManager
from dtrain.training.dist import DistContext, init_distributed
from dtrain.training.metrics import MetricsWriter, write_result
from dtrain.training.scaling import scaled_lr, warmup_factor

__all__ = [
    "CheckpointManager", "DistContext", "init_distributed", "MetricsWriter", "write_result",
    "scaled_lr", "warmup_factor",
]
