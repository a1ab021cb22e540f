"""The epoch loop a DDP script otherwise writes itself: resume or warm start, steps with checkpoints and
per-rank metrics, and a coordinated stop on SIGTERM.

    loop = TrainLoop(model, optimizer, rank=ctx.rank, checkpoint_every=50)
    loop.time_collectives(ddp_model)                       # optional: names a straggler
    loop.restore(init_from=args.init_from, load_weights=lambda path: model.load_state_dict(torch.load(path)))
    step = loop.run(loader, sampler, epochs, train_step)   # train_step(batch) -> (loss, samples)

``train_step`` returns the loss as a tensor (``loss.detach()``; best: the step never waits for the
device) or a float (``loss.item()``: a wait for the device every step). A tensor loss is read in
chunks of ``metrics_every`` steps once the device has passed them (:class:`StepRecorder`); the step
time and data wait are CUDA events on a GPU, host time on a CPU. The loss of the last step is
``loop.last_loss`` once ``run`` returns.

``run`` resumes mid-epoch where a checkpoint left off (the sampler's order is fixed by seed and
epoch, so the batches already trained are skipped), saves every ``checkpoint_every`` steps, and on
SIGTERM stops every rank after the same step, saves that step and exits with the guard's code (143).
The script keeps what is its own: the model, the loss, what it writes at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Iterable

from dtrain.training.checkpoint import CheckpointManager
from dtrain.training.collectives import CollectiveTimer
from dtrain.training.dist import shutdown
from dtrain.training.metrics import MetricsWriter, StepRecorder, step_clock
from dtrain.training.preemption import PreemptionGuard


def script_args(description: str, *, epochs: int, lr: float, batch_size: int) -> argparse.ArgumentParser:
    """The arguments a retraining pipeline's ``train_command`` fills ({shards}, {output}, {init_from},
    {params.epochs}, {params.lr}), plus batch size, checkpoint interval and seed, with the script's
    defaults. Add the script's own before ``parse_args``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shards", required=True, help="preprocessed shard directory (with manifest.json)")
    p.add_argument("--output", required=True, help="where rank 0 writes the trained model")
    p.add_argument("--init-from", default="", help="warm-start model, used when the file exists ('' = none)")
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--batch-size", type=int, default=batch_size, help="per-rank batch size")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0)
    return p


class TrainLoop:
    """Args:
        model: the module whose ``state_dict`` is checkpointed (the unwrapped one, not DDP's wrapper).
        optimizer: checkpointed with it.
        rank: this process's global rank (rank 0 writes checkpoints).
        checkpoint_every: steps between checkpoints.
        guard: the PreemptionGuard installed by the script (default: one installed now).
        metrics_every: steps whose metrics are read from the device together (a tensor loss is read
            once per this many steps, or once ``metrics_delay_s`` seconds passed); default 50 on a
            GPU, and 1 on the CPU, where a loss costs nothing to read (a rank killed loses no line).
        device: where the steps run (default: the model's first parameter's device): on CUDA the
            step times are CUDA events.
    """

    def __init__(self, model: Any, optimizer: Any, *, rank: int, checkpoint_every: int = 50,
                 guard: PreemptionGuard | None = None, metrics_every: int | None = None, metrics_delay_s: float = 1.0,
                 device: Any = None):
        self.model, self.optimizer, self.is_main = model, optimizer, rank == 0
        self.guard = guard or PreemptionGuard()
        self.ckpt = CheckpointManager(every_n_steps=checkpoint_every, rank=rank)
        self.clock = step_clock(device if device is not None else _device_of(model))
        self.metrics = StepRecorder(MetricsWriter(rank), self.clock, every=metrics_every,
                                    max_delay_s=metrics_delay_s)
        self.collectives: CollectiveTimer | None = None
        self.step, self.warm_start = 0, None
        self.resumed_from = 0

    @property
    def last_loss(self) -> float:
        """The loss of the last step written to the metrics (every step once ``run`` returned); nan
        before any."""
        return self.metrics.last_loss

    def time_collectives(self, train_model: Any) -> None:
        """Record each step's wait in the gradient all-reduce of ``train_model`` (the DDP wrapper; call
        before its first forward; a model that is not DDP is left alone), so that the stall report
        can name a straggler (:mod:`dtrain.training.collectives`)."""
        self.collectives = CollectiveTimer.of(train_model)

    def _say(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def restore(self, init_from: str = "", load_weights: Callable[[str], None] | None = None) -> None:
        """Resume from the latest checkpoint when there is one (it already holds any warm start);
        otherwise load ``init_from`` with ``load_weights`` when that file exists ('' = none)."""
        state = self.ckpt.load_latest()
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step, self.warm_start = state["step"], state.get("warm_start_from")
            self.ckpt.last_saved_step = self.step  # the checkpoint for this step exists
            self._say(f"resumed from checkpoint at step {self.step}")
        elif init_from and os.path.isfile(init_from) and load_weights is not None:
            load_weights(init_from)
            self.warm_start = init_from
            self._say(f"warm start from {init_from}")
        self.resumed_from = self.step

    def save(self) -> None:
        self.ckpt.save(self.step, {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                                   "warm_start_from": self.warm_start})

    def run(self, loader: Iterable, sampler: Any, epochs: int, train_step: Callable[[Any], tuple[Any, int]]) -> int:
        """Train until ``epochs`` x len(loader) steps; returns the step reached. On a stop request it
        saves and exits the process (it does not return)."""
        steps_per_epoch = len(loader)
        total_steps = steps_per_epoch * epochs
        preempted = False
        try:
            while self.step < total_steps and not preempted:
                preempted = self._epoch(loader, sampler, steps_per_epoch, train_step)
        except Exception:
            if not self.guard.stop_requested():
                raise
            # Told to stop and a collective failed: a peer left before the ranks agreed on a step, so
            # no coordinated checkpoint is possible (the periodic one stands). Exit without teardown,
            # and without waiting for steps queued behind the failed collective.
            self.metrics.close(wait=False)
            self.guard.exit()
        self.metrics.close()
        if preempted:
            self._stop()
        return self.step

    def _epoch(self, loader: Iterable, sampler: Any, steps_per_epoch: int, train_step: Callable) -> bool:
        epoch, skip = divmod(self.step, steps_per_epoch)
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(skip):  # a resume mid-epoch: skip the batches the interrupted run trained on
            next(batches)
        while True:
            fetch = self.clock.mark()
            try:
                batch = next(batches)
            except StopIteration:
                return False
            start = self.clock.mark()
            loss, samples = train_step(batch)
            self.step += 1
            self.metrics.record(step=self.step, epoch=epoch, loss=loss, samples=samples,
                                marks=(fetch, start, self.clock.mark()),
                                comm_wait_s=self.collectives.take() if self.collectives else None)
            if self.ckpt.should_save(self.step):
                self.save()
            if self.guard.should_stop():  # SIGTERM on any rank: every rank stops after this same step
                return True

    def _stop(self) -> None:
        if self.guard.peers_lost:
            self.guard.exit()
        if self.ckpt.last_saved_step != self.step:
            self.save()
        self._say(f"preempted: checkpoint saved at step {self.step}")
        shutdown()
        sys.exit(self.guard.exit_code)


def _device_of(model: Any) -> Any:
    for parameter in model.parameters():
        return parameter.device
    return "cpu"
