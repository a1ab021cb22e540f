"""Read what DeepSpeed's autotuner wrote (``autotuning_results/``): the optimal config, the summary
table, each experiment's metric or error. Reads are bounded; nothing here runs DeepSpeed.

Layout (deepspeed/autotuning/autotuner.py, scheduler.py; DeepSpeed 0.19):

    autotuning_results/summary.txt              pipe table: tuning_space | num_experiments | best_metric_val | best_exp_name
    autotuning_results/ds_config_optimal.json   the best experiment's config, "autotuning" removed
    autotuning_results/cmd_optimal.txt          the best experiment's command line
    autotuning_results/<experiment>/{ds_config.json, exp.json, metrics.json, stderr.log, stdout.log, cmd.txt}
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from dtrain.errors import DTrainError

MAX_JSON_BYTES = 1 << 20
MAX_LOG_BYTES = 4 << 20  # an experiment's stderr is scanned for errors up to this many bytes
ERROR_LINE = re.compile(r"error", re.IGNORECASE)  # DeepSpeed's own test (autotuning/utils.py search_error)


class AutotuneError(DTrainError):
    """Autotuning produced no usable result (every experiment failed, or DeepSpeed stopped early)."""


def _read(path: str, limit: int) -> str:
    if os.path.islink(path):
        raise AutotuneError(f"{path} is a symbolic link: not written by DeepSpeed's autotuner")
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise AutotuneError(f"{path} is larger than {limit} bytes: not written by DeepSpeed's autotuner")
    return data.decode("utf-8", "replace")


def _json(path: str) -> Any:
    return json.loads(_read(path, MAX_JSON_BYTES))


def parse_summary(text: str) -> list[dict[str, Any]]:
    """The rows of summary.txt's table (tuning_space, num_experiments, best_metric_val, best_exp_name)."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set(":-"):
            row = dict(zip(header, cells))
            for key, kind in (("num_experiments", int), ("best_metric_val", float)):
                if key in row:
                    try:
                        row[key] = kind(row[key])
                    except ValueError:
                        pass
            rows.append(row)
    return rows


def experiment(directory: str) -> dict[str, Any]:
    """One experiment: its name, ds_config, metrics (when it finished) and first error lines."""
    name = os.path.basename(directory)
    out: dict[str, Any] = {"name": name}
    for key, file in (("metrics", "metrics.json"), ("model_info", "model_info.json"), ("ds_config", "ds_config.json")):
        path = os.path.join(directory, file)
        if os.path.isfile(path):
            out[key] = _json(path)
    stderr = os.path.join(directory, "stderr.log")
    errors = [line for line in _read(stderr, MAX_LOG_BYTES).splitlines() if ERROR_LINE.search(line)] \
        if os.path.isfile(stderr) else []
    out["errors"] = errors[:5]
    out["status"] = "failed" if errors else "ok" if "metrics" in out or "model_info" in out else "no result"
    return out


def experiment_ports(results_dir: str) -> list[int]:
    """The master port of every experiment (its exp.json), for cleaning up after them."""
    ports = []
    try:
        names = sorted(os.listdir(results_dir))
    except OSError:
        return []
    for name in names:
        path = os.path.join(results_dir, name, "exp.json")
        if not os.path.isfile(path):
            continue
        try:
            port = _json(path).get("master_port")
        except (AutotuneError, ValueError, AttributeError, OSError):
            continue
        if isinstance(port, int) and 0 < port < 65536:
            ports.append(port)
    return ports


def read_results(results_dir: str) -> dict[str, Any]:
    """Everything the XCom hand-off needs; AutotuneError naming the failed experiments when no optimum exists."""
    if not os.path.isdir(results_dir):
        raise AutotuneError(f"DeepSpeed wrote no {results_dir}: the autotuner did not start (see its output)")
    experiments = [experiment(os.path.join(results_dir, n)) for n in sorted(os.listdir(results_dir))
                   if os.path.isdir(os.path.join(results_dir, n))]
    optimal = os.path.join(results_dir, "ds_config_optimal.json")
    if not os.path.isfile(optimal):
        failed = [e for e in experiments if e["status"] != "ok"] or experiments
        detail = "; ".join(f"{e['name']}: {(e['errors'] or [e['status']])[0][:300]}" for e in failed[:5])
        raise AutotuneError(f"DeepSpeed's autotuner found no runnable configuration ({len(experiments)} "
                            f"experiment(s)): {detail or 'none ran'}")
    summary = os.path.join(results_dir, "summary.txt")
    summary_text = _read(summary, MAX_JSON_BYTES) if os.path.isfile(summary) else ""
    rows = parse_summary(summary_text)
    best = next((r for r in rows if r.get("tuning_space") == "global"), rows[-1] if rows else {})
    cmd = os.path.join(results_dir, "cmd_optimal.txt")
    return {
        "optimal_config": _json(optimal),
        "best_experiment": best.get("best_exp_name"),
        "best_metric_value": best.get("best_metric_val"),
        "summary": rows,
        "summary_text": summary_text,
        "cmd_optimal": _read(cmd, MAX_JSON_BYTES).strip() if os.path.isfile(cmd) else None,
        "experiments": [{k: e.get(k) for k in ("name", "status", "errors")}
                        | {"metric": (e.get("metrics") or {}).get("throughput")} for e in experiments],
        "results_dir": results_dir,
    }
