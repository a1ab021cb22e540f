"""A hostile rank (issue 22): plants links in its own run directory, then exits.

    plant.py NAME=TARGET [NAME=TARGET ...] [--exit CODE] [--print TEXT]

NAME is a path relative to DTRAIN_RUN_DIR (``{SLURM_JOB_ID}`` filled from the env); whatever is
there is removed first, then a symlink to TARGET is made. Only rank 0 plants.
"""

import os
import shutil
import sys

args = sys.argv[1:]
code, text = 0, None
if "--exit" in args:
    i = args.index("--exit")
    code = int(args[i + 1])
    del args[i:i + 2]
if "--print" in args:
    i = args.index("--print")
    text = args[i + 1]
    del args[i:i + 2]
if os.environ.get("RANK", "0") == "0":
    run_dir = os.environ["DTRAIN_RUN_DIR"]
    for pair in args:
        name, target = pair.split("=", 1)
        path = os.path.join(run_dir, name.replace("{SLURM_JOB_ID}", os.environ.get("SLURM_JOB_ID", "")))
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(target, path)
if text:
    print(text, flush=True)
sys.exit(code)
