"""``dtrain``: the command-line front end (launch, stage, plan, preprocess, autotune).

Each capability registers its own subcommand from a module listed here, imported
when the CLI starts; nothing heavy is imported before a subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dtrain.errors import DTrainError

SUBCOMMAND_MODULES = (
    "dtrain.launch.engine.cli",
    "dtrain.staging.cli",
    "dtrain.preprocess.cli",
    "dtrain.autotune.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtrain", description="Distributed training pipeline tools.")
    subparsers = parser.add_subparsers(dest="subcommand", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DTrainError as e:
        print(f"dtrain {args.subcommand}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2) or 2


if __name__ == "__main__":
    sys.exit(main())
