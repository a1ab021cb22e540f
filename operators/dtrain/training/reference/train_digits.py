"""Reference training script: an MLP on scikit-learn's digits (shipped inside scikit-learn), with DDP or DeepSpeed.

Run it on every rank through the launcher, for example

    dtrain launch --nodes 2 --procs-per-node 2 -- python -m dtrain.training.reference.train_digits --epochs 20
    dtrain launch --procs-per-node 2 --distribution deepspeed --deepspeed-config ds.json -- \
        python -m dtrain.training.reference.train_digits --deepspeed

It checkpoints every ``--checkpoint-every`` steps and resumes from the latest
checkpoint when relaunched with the same run directory; it writes per-rank
metrics and, on rank 0, ``result.json`` with the test accuracy.

On SIGTERM (a preemption, a stop: dtrain.training.preemption) every rank finishes its
current step, the ranks agree on the step to stop at, a checkpoint for that step is
saved (unless the periodic one just covered it), rank 0 prints
``preempted: checkpoint saved at step N`` and every rank exits 143; the relaunch
resumes from step N.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from dtrain.atomic import atomic_open
from dtrain.training.checkpoint import CheckpointManager
from dtrain.training.collectives import CollectiveTimer, probe_links
from dtrain.training.dist import exit_now, init_distributed, shutdown
from dtrain.training.metrics import MetricsWriter, StepRecorder, step_clock, write_result
from dtrain.training.preemption import PreemptionGuard
from dtrain.training.scaling import scaled_lr, warmup_factor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (DDP)")
    p.add_argument("--base-lr", type=float, default=0.05, help="learning rate at --base-batch")
    p.add_argument("--base-batch", type=int, default=32, help="global batch the base LR is tuned for")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds added to each step (to watch or kill a run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-links", action="store_true",
                   help="after training, time what each node receives from the previous one (the stall "
                        "report's SlowLink)")
    p.add_argument("--deepspeed", action="store_true",
                   default=os.environ.get("DTRAIN_DISTRIBUTION") == "deepspeed" and "DTRAIN_DEEPSPEED_CONFIG" in os.environ,
                   help="train with DeepSpeed, config from DTRAIN_DEEPSPEED_CONFIG (default when launched "
                        "with distribution=deepspeed)")
    p.add_argument("--shards", help="read training data from preprocessed shards in this directory")
    p.add_argument("--output", help="where rank 0 writes the trained model (default: run dir/model.pt)")
    p.add_argument("--init-from", help="warm-start weights from this model file, if it exists")
    return p.parse_args(argv)


def load_digits_split(seed: int = 0):
    """Features scaled to [0, 1]; a fixed 80/20 train/test split, identical on every rank."""
    import numpy as np

    from dtrain.preprocess.digits import load_digits_arrays

    pixels, labels = load_digits_arrays()
    x = (pixels / 16.0).astype(np.float32)
    y = labels.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(len(x) * 0.8)
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def build_model(hidden: int):
    import torch.nn as nn

    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def train_dataset(args, seed: int):
    import torch
    from torch.utils.data import TensorDataset

    (x_train, y_train), test = load_digits_split(seed)
    if args.shards:
        from dtrain.training.shards import ShardDataset  # preprocessed, memory-mapped shards

        return ShardDataset(args.shards), test
    return TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)), test


def evaluate(model, test, device) -> float:
    import torch

    x_test, y_test = test
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x_test).to(device))
        accuracy = (logits.argmax(dim=1).cpu() == torch.from_numpy(y_test)).float().mean().item()
    model.train()
    return accuracy


def atomic_save(obj, path: str) -> None:
    import torch

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_open(path, mode=0o666) as fh:  # 0o666: the umask decides, as torch.save(obj, path) did
        torch.save(obj, fh)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    torch.manual_seed(args.seed)
    # With DeepSpeed the process group is made here, bound to this rank's GPU, and DeepSpeed reuses it
    # (its own has no device at world size 1).
    ctx = init_distributed(group_of_one=args.deepspeed)
    # From here SIGTERM asks for a checkpoint and a clean exit (before it, the default: a rank
    # still joining the process group has nothing to save).
    guard = PreemptionGuard()
    device = torch.device(ctx.device)
    dataset, test = train_dataset(args, args.seed)
    model = build_model(args.hidden).to(device)
    warm_start = None
    if args.init_from and os.path.isfile(args.init_from):
        model.load_state_dict(torch.load(args.init_from, map_location=device))
        warm_start = args.init_from
        print(f"warm start from {args.init_from}")

    ds_config = None
    if args.deepspeed:
        with open(os.environ["DTRAIN_DEEPSPEED_CONFIG"], encoding="utf-8") as fh:
            ds_config = json.load(fh)
        per_rank_batch = ds_config["train_micro_batch_size_per_gpu"]
        global_batch = ds_config["train_batch_size"]
    else:
        per_rank_batch = args.batch_size
        global_batch = args.batch_size * ctx.world_size
    lr = scaled_lr(args.base_lr, global_batch, args.base_batch)
    if ctx.is_main:
        print(f"world_size={ctx.world_size} global_batch={global_batch} lr={lr:.4f} "
              f"(base_lr={args.base_lr} x {global_batch}/{args.base_batch})")

    if args.shards:  # the shard reader splits by rank itself (epoch-seeded, equal counts per rank)
        from dtrain.training.shards import ShardLoader, ShardSampler

        sampler = ShardSampler(len(dataset), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                               seed=args.seed, drop_last=True)
        # Batches are slices of one memory-mapped read: no per-sample collate on the CPU.
        loader = ShardLoader(dataset, per_rank_batch, sampler)
    else:
        sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                     seed=args.seed, drop_last=True)
        loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_factor(s, args.warmup_steps))
    ckpt = CheckpointManager(every_n_steps=args.checkpoint_every, rank=ctx.rank)

    step = 0
    if args.deepspeed:
        import deepspeed

        ds_config.setdefault("zero_allow_untested_optimizer", True)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        state = ckpt.load_deepspeed(engine)
        step = state["step"] if state else 0
        train_model = engine
    else:
        state = ckpt.load_latest()
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            step = state["step"]
        train_model = torch.nn.parallel.DistributedDataParallel(model) if ctx.world_size > 1 else model
    collectives = CollectiveTimer.of(train_model)  # each step's all-reduce wait: finds a straggler
    resumed_from = step
    if step:
        ckpt.last_saved_step = step  # the checkpoint for this step exists
        if ctx.is_main:
            print(f"resumed from checkpoint at step {step}")

    def save_checkpoint() -> None:
        if args.deepspeed:
            ckpt.save_deepspeed(train_model, step)  # every rank writes its shards
        else:
            ckpt.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "scheduler": scheduler.state_dict()})

    # Losses and step times read from the device in chunks, once it has passed them: no wait per step.
    clock = step_clock(device)
    metrics = StepRecorder(MetricsWriter(ctx.rank), clock)
    loss_fn = torch.nn.CrossEntropyLoss()
    total_steps = steps_per_epoch * args.epochs
    loss = torch.tensor(0.0)
    preempted = False
    try:
        while step < total_steps and not preempted:
            epoch, skip = divmod(step, steps_per_epoch)
            sampler.set_epoch(epoch)  # same order as the interrupted run, so a resume skips exactly what was done
            batches = iter(loader)
            for _ in range(skip):
                next(batches)
            while True:
                fetch = clock.mark()
                try:
                    x, y = next(batches)
                except StopIteration:
                    break
                start = clock.mark()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = loss_fn(train_model(x), y)
                if args.deepspeed:
                    train_model.backward(loss)
                    train_model.step()
                else:
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    scheduler.step()
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                step += 1
                metrics.record(step=step, epoch=epoch, loss=loss, samples=len(y), marks=(fetch, start, clock.mark()),
                               comm_wait_s=collectives.take() if collectives else None)
                if ckpt.should_save(step):
                    save_checkpoint()
                if guard.should_stop():  # SIGTERM on any rank: every rank stops after this same step
                    preempted = True
                    break
    except Exception as e:
        if not guard.stop_requested():
            raise
        # Told to stop, and a collective failed here: a peer left without agreeing on a step (it
        # failed, or was killed outright). No coordinated checkpoint is possible (the periodic one
        # stands); exit now rather than wait for the SIGKILL, or for steps queued behind the failed collective.
        metrics.close(wait=False)
        if ctx.is_main:
            print(f"stopped: a peer left before the ranks agreed on a step ({type(e).__name__}); "
                  f"no checkpoint saved", flush=True)
        guard.exit()  # no interpreter teardown: a process group whose peer is gone may abort in it
    if args.probe_links and not preempted:
        link = probe_links(device)
        if link:
            metrics.log_link(link)
    metrics.close()
    if preempted:
        if guard.peers_lost:  # the same, seen by the agreement itself
            if ctx.is_main:
                print("stopped: a peer left before the ranks agreed on a step; no checkpoint saved", flush=True)
            guard.exit()
        if ckpt.last_saved_step != step:
            save_checkpoint()
        if ctx.is_main:
            print(f"preempted: checkpoint saved at step {step}", flush=True)
        shutdown()
        return guard.exit_code

    accuracy = evaluate(model if not args.deepspeed else train_model.module, test, device)
    if ctx.world_size > 1:
        dist.barrier()
    if ctx.is_main:
        output = args.output or os.path.join(os.environ.get("DTRAIN_RUN_DIR", os.getcwd()), "model.pt")
        atomic_save((train_model.module if args.deepspeed else model).state_dict(), output)
        write_result({
            "test_accuracy": round(accuracy, 4), "steps": step, "epochs": args.epochs,
            "world_size": ctx.world_size, "global_batch": global_batch, "lr": lr,
            "final_loss": round(float(loss.item()), 4), "resumed_from_step": resumed_from,
            "distribution": "deepspeed" if args.deepspeed else "pytorch", "model_path": output,
            "warm_start_from": warm_start,
            **({"zero_stage": train_model.zero_optimization_stage()} if args.deepspeed else {}),
        })
        print(f"test accuracy: {accuracy:.4f}")
    shutdown()
    return 0


if __name__ == "__main__":
    exit_now(main())  # no interpreter teardown: with gloo it can abort a finished rank (dist.exit_now)
