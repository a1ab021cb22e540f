"""What the DeepSpeed test scripts saw, printed and (with --report-dir) written per rank for the tests."""

import json
import os


def report(args, fields):
    print(json.dumps(fields), flush=True)
    if args.report_dir:
        with open(os.path.join(args.report_dir, f"report-rank{fields['rank']}.json"), "w") as fh:
            json.dump(fields, fh)
