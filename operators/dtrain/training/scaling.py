"""Linear learning-rate scaling with gradual warmup (Goyal et al. 2017, as the SageMaker guide advises)."""

from __future__ import annotations


def scaled_lr(base_lr: float, global_batch: int, base_batch: int) -> float:
    """lr = base_lr x global_batch / base_batch."""
    if base_lr <= 0 or global_batch <= 0 or base_batch <= 0:
        raise ValueError(f"scaled_lr needs positive values, got base_lr={base_lr}, "
                         f"global_batch={global_batch}, base_batch={base_batch}")
    return base_lr * global_batch / base_batch


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Multiplier ramping linearly from 1/warmup_steps to 1 over the first warmup_steps steps
    (use with torch.optim.lr_scheduler.LambdaLR)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    return (step + 1) / warmup_steps
