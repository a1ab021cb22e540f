"""``dtrain autotune [options] -- [python] SCRIPT.py ARGS``: DeepSpeed's own autotuner for a training command.

Prints the summary table and writes the optimal config to ``--output`` (default
``<work-dir>/autotuning_results/ds_config_optimal.json``, where DeepSpeed puts it); exit 0 with
a result, 1 when no configuration ran, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("autotune", help="run DeepSpeed's autotuner for a training command",
                              description="Run `deepspeed --autotuning tune` for CMD and print the optimal config.")
    p.add_argument("--deepspeed-config", required=True, metavar="FILE", help="DeepSpeed JSON config")
    p.add_argument("--autotuning", metavar="JSON", default=None,
                   help='autotuning options overriding the config\'s section, e.g. \'{"tuner_num_trials": 10}\'')
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--procs-per-node", type=int, default=1, help="slots per node (GPUs, or CPU ranks)")
    p.add_argument("--hosts", default=None, help="comma-separated node addresses (several nodes; DeepSpeed uses pdsh)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"))
    p.add_argument("--work-dir", required=True, help="where autotuning_results/ and autotuning_exps/ go")
    p.add_argument("--output", default=None, help="also write the optimal config here")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- [python] SCRIPT.py ARGS")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dtrain.autotune.results import AutotuneError
    from dtrain.autotune.runner import AutotuneSpec, run_autotune
    from dtrain.errors import SpecError
    from dtrain.launch.backends.placement import visible_gpu_count

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        overrides = json.loads(args.autotuning) if args.autotuning else None
    except json.JSONDecodeError as e:
        raise SpecError("--autotuning", args.autotuning, f"a JSON object ({e.msg})") from e
    if overrides is not None and not isinstance(overrides, dict):
        raise SpecError("--autotuning", args.autotuning, "a JSON object")
    device = args.device if args.device != "auto" else ("gpu" if visible_gpu_count() > 0 else "cpu")
    hosts = [h.strip() for h in args.hosts.split(",")] if args.hosts else None
    spec = AutotuneSpec(command=command, deepspeed_config=args.deepspeed_config, autotuning=overrides,
                        nodes=args.nodes, procs_per_node=args.procs_per_node, hosts=hosts, device=device,
                        work_dir=args.work_dir)
    try:
        result = run_autotune(spec, sink=lambda line: print(line, flush=True))
    except AutotuneError as e:
        print(f"dtrain autotune: {e}", file=sys.stderr)
        return 1
    print(result["summary_text"])
    print(f"optimal config ({result['best_experiment']}, throughput {result['best_metric_value']}): "
          f"{json.dumps(result['optimal_config'], sort_keys=True)}")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(result["optimal_config"], fh, indent=2, sort_keys=True)
    return 0
