"""Where the data stopped, in a form that resumes at another world size.

A DistributedSampler (or :class:`~dtrain.training.shards.ShardSampler`) deals each epoch's
permutation round-robin: rank r takes positions r, r + W, r + 2W, ... So after every rank trained
s batches of b samples, the job has consumed exactly the first s x b x W positions of the epoch's
permutation, whatever W is. :class:`ResumableSampler` records that count (``consumed``) and, on
resume, deals only the rest of the permutation to the ranks of the new world, so no sample of the
epoch is trained twice or skipped when 4 ranks stop and 2 go on (or 2 -> 4).

    sampler = ResumableSampler(DistributedSampler(dataset, seed=0))    # or ShardSampler(len(dataset))
    ckpt.load_latest(into={"app": ModelState(model, opt), "data": sampler})   # a Stateful: epoch, consumed
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)                 # same epoch as the checkpoint's: keeps its position
        for batch in DataLoader(dataset, batch_size=b, sampler=sampler):   # or ShardLoader
            train_step(batch)
            sampler.advance(len(batch))          # this rank's samples; every rank advances alike
            ...ckpt.save(step, {"app": ..., "data": sampler})

The epoch's order comes from the wrapped sampler itself (a one-rank copy of it yields the whole
permutation), so it is exactly the order that sampler would have dealt.
"""

from __future__ import annotations

from typing import Any, Iterator


class ResumableSampler:
    """Wrap a DistributedSampler or ShardSampler (its seed, shuffle, drop_last, rank and world size)."""

    def __init__(self, base: Any):
        self.base = base
        self.num_replicas, self.rank = base.num_replicas, base.rank
        self.drop_last = base.drop_last
        self.epoch = 0
        #: positions of this epoch's permutation the whole job has trained
        self.consumed = 0

    # -- the epoch's whole order, from the wrapped sampler ---------------------------------------

    def _epoch_order(self):
        import numpy as np

        whole = self._one_rank_copy()
        whole.set_epoch(self.epoch)
        if hasattr(whole, "indices_array"):
            return whole.indices_array()
        return np.fromiter(iter(whole), dtype=np.int64)

    def _one_rank_copy(self):
        from dtrain.training.shards import ShardSampler

        base = self.base
        if isinstance(base, ShardSampler):
            return ShardSampler(base.num_samples_total, 1, 0, shuffle=base.shuffle, seed=base.seed)
        from torch.utils.data.distributed import DistributedSampler

        if isinstance(base, DistributedSampler):
            return DistributedSampler(base.dataset, num_replicas=1, rank=0, shuffle=base.shuffle, seed=base.seed)
        raise TypeError(f"ResumableSampler wraps a DistributedSampler or a ShardSampler, not {type(base).__name__}")

    # -- the sampler interface (DataLoader, ShardLoader) -----------------------------------------

    def indices_array(self):
        """This rank's indices for the rest of the epoch: the positions not yet consumed, dealt round-robin
        (padded with their first ones, or cut, to a multiple of the world size, as the wrapped sampler does)."""
        import numpy as np

        rest = self._epoch_order()[self.consumed:]
        whole, extra = divmod(len(rest), self.num_replicas)
        if extra and self.drop_last:
            rest = rest[: whole * self.num_replicas]
        elif extra:
            rest = np.concatenate([rest, rest[: self.num_replicas - extra]])
        return rest[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices_array().tolist())

    def __len__(self) -> int:
        rest = len(self._epoch_order()) - self.consumed
        return rest // self.num_replicas if self.drop_last else -(-rest // self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless it is the epoch the position was restored in."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def advance(self, samples_per_rank: int) -> None:
        """Every rank trained ``samples_per_rank`` more samples of this epoch."""
        self.consumed += samples_per_rank * self.num_replicas

    # -- a DCP Stateful -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if epoch < 0 or consumed < 0:
            raise ValueError(f"data position epoch={epoch} consumed={consumed} must not be negative")
        self.epoch, self.consumed = epoch, consumed
