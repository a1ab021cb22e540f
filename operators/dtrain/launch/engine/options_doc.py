"""The options tables of docs/backends.md, generated from the tables that declare the options.

Each table sits between ``<!-- options: NAME -->`` and ``<!-- end options: NAME -->``: ``job`` is
:data:`~dtrain.launch.core.spec_options.JOB_OPTIONS`, a backend's name is that backend's table (its
``options`` attribute). Regenerate after changing an option::

    python -m dtrain.launch.engine.options_doc docs/backends.md

``--check`` changes nothing and exits 1 when the file differs from what the tables generate
(tests/launch/core/test_options.py runs it).
"""

from __future__ import annotations

import argparse
import re
import sys

from dtrain.options import Options
from dtrain.launch.core.spec_options import JOB_OPTIONS

_SECTION = re.compile(r"(<!-- options: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end options: (?P=name) -->)", re.S)
#: ``{backends}`` in help texts: the built-in backends (the installed ones vary between hosts)
DOC_CONTEXT = {"backends": "local, ssh, slurm, mpi or an installed one"}


def table_of(name: str) -> Options:
    if name == "job":
        return JOB_OPTIONS
    from dtrain.launch.backends import get_backend_class

    options = getattr(get_backend_class(name), "options", None)
    if not isinstance(options, Options):
        raise KeyError(f"backend {name!r} declares no options table")
    return options


def render(text: str) -> str:
    """``text`` with every options section replaced by its table."""
    return _SECTION.sub(lambda m: m.group(1) + table_of(m.group("name")).markdown(DOC_CONTEXT) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.launch.engine.options_doc", description=__doc__)
    parser.add_argument("path", help="the Markdown file holding the tables (docs/backends.md)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is not up to date; write nothing")
    args = parser.parse_args(argv)
    with open(args.path, encoding="utf-8") as fh:
        text = fh.read()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{args.path}: options tables out of date; run python -m dtrain.launch.engine.options_doc "
                  f"{args.path}", file=sys.stderr)
        return int(new != text)
    if new != text:
        with open(args.path, "w", encoding="utf-8") as fh:
            fh.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
