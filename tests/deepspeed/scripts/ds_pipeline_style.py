"""A pipeline-parallel script written the way DeepSpeedExamples' pipeline_parallelism/train.py is:
a PipelineModule split into --pipeline-parallel-size stages, deepspeed.initialize(args=...),
engine.train_batch(). With 2 ranks and 2 stages the data-parallel size is 1, so a config of
train_batch_size 256 = micro 8 x accumulation 32 x 1 is valid (DeepSpeed's own arithmetic)."""

import argparse
import os

import deepspeed
import torch
from deepspeed.pipe import PipelineModule
from ds_report import report


def get_args():
    parser = argparse.ArgumentParser(description="tiny pipeline")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=2, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument("--report-dir", default=None, help="also write this rank's report here")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    layers = [torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
              torch.nn.Linear(32, 4)]
    net = PipelineModule(layers=layers, loss_fn=torch.nn.CrossEntropyLoss(), num_stages=args.pipeline_parallel_size,
                         partition_method="parameters", activation_checkpoint_interval=0)
    data = torch.utils.data.TensorDataset(torch.randn(2048, 16), torch.randint(0, 4, (2048,)))
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=data)
    for _ in range(args.steps):
        loss = engine.train_batch()
    report(args, {
        "script": "pipeline", "rank": engine.global_rank, "local_rank_arg": args.local_rank,
        "stage": engine.stage_id, "stages": engine.num_stages, "dp": engine.dp_world_size,
        "train_batch_size": engine.train_batch_size(), "micro": engine.train_micro_batch_size_per_gpu(),
        "gas": engine.gradient_accumulation_steps(), "global_steps": engine.global_steps,
        "loss": float(loss), "LOCAL_SIZE": os.environ.get("LOCAL_SIZE")})


if __name__ == "__main__":
    main()
