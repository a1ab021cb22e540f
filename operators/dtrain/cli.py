"""``dtrain``: the command-line front end (launch, stage, plan, preprocess, autotune).

Each capability registers its own subcommand from a module listed here. A command line that
names a subcommand imports and registers that subcommand's module alone (``dtrain launch`` pays
for no other subcommand's imports and options before its job starts); any other (``dtrain
--help``, a typo) builds the whole parser, so help and errors list every subcommand. Nothing
heavy is imported before a subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dtrain.errors import DTrainError

#: each subcommand and the module that registers it (a module may register several)
SUBCOMMANDS = {
    "launch": "dtrain.launch.engine.cli",
    "stage": "dtrain.staging.cli",
    "plan": "dtrain.staging.cli",
    "preprocess": "dtrain.preprocess.cli",
    "autotune": "dtrain.autotune.cli",
}
SUBCOMMAND_MODULES = tuple(dict.fromkeys(SUBCOMMANDS.values()))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: with only the named subcommand's module registered when ``argv``
    starts with a subcommand (the only one argparse would use for it), else with every one."""
    parser = argparse.ArgumentParser(prog="dtrain", description="Distributed training pipeline tools.")
    subparsers = parser.add_subparsers(dest="subcommand", required=True)
    named = SUBCOMMANDS.get(argv[0]) if argv else None
    for name in (named,) if named else SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DTrainError as e:
        print(f"dtrain {args.subcommand}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2) or 2


if __name__ == "__main__":
    sys.exit(main())
