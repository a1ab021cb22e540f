"""A ZeRO training script written the way DeepSpeedExamples' cifar10_deepspeed.py is: argparse with
--local_rank and deepspeed.add_config_arguments, deepspeed.initialize(args=...), the optimizer from
the config. Launched unchanged by dtrain with `--deepspeed --deepspeed_config {deepspeed_config}`
and --pass-local-rank; prints one JSON line per rank with what it saw."""

import argparse
import os

import deepspeed
import torch
from ds_report import report


def add_argument():
    parser = argparse.ArgumentParser(description="tiny ZeRO")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--report-dir", default=None, help="also write this rank's report here")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    net = Net()
    engine, _, loader, _ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(),
                                                training_data=data)
    criterion = torch.nn.CrossEntropyLoss()
    batches = iter(loader)
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x, y = next(batches)
        loss = criterion(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
    report(args, {
        "script": "zero", "rank": engine.global_rank, "local_rank_arg": args.local_rank,
        "LOCAL_RANK": int(os.environ["LOCAL_RANK"]), "deepspeed_config": args.deepspeed_config,
        "LOCAL_SIZE": os.environ.get("LOCAL_SIZE"), "CROSS_RANK": os.environ.get("CROSS_RANK"),
        "CROSS_SIZE": os.environ.get("CROSS_SIZE"), "zero_stage": engine.zero_optimization_stage(),
        "train_batch_size": engine.train_batch_size(), "micro": engine.train_micro_batch_size_per_gpu(),
        "gas": engine.gradient_accumulation_steps(), "global_steps": engine.global_steps,
        "loss": float(loss)})


if __name__ == "__main__":
    main()
