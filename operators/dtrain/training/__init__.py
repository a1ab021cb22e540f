"""What a training script imports: init from the env contract, checkpoint/resume, metrics, LR scaling.

    from operators.training import init_distributed, CheckpointManager, MetricsWriter, scaled_lr

Submodules import torch lazily, so importing this package stays cheap.
"""

from operators.training.checkpoint import CheckpointManager
from operators.training.dist import DistContext, init_distributed
from operators.training.metrics import MetricsWriter, write_result
from operators.training.scaling import scaled_lr, warmup_factor

__all__ = [
    "CheckpointManager", "DistContext", "init_distributed", "MetricsWriter", "write_result",
    "scaled_lr", "warmup_factor",
]
