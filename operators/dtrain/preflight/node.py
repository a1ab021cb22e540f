"""``python -m dtrain.preflight.node '<json kwargs>'``: run check_node here, print one JSON line."""

from __future__ import annotations

import json
import sys

from dtrain.preflight.checks import check_node

MARK = "DTRAIN-PREFLIGHT "


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    kwargs = json.loads(args[0]) if args else {}
    print(MARK + json.dumps(check_node(**kwargs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
