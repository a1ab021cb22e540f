"""Read what DeepSpeed's autotuner wrote (``autotuning_results/``): the optimal config, the summary
table, each experiment's metric or error. Nothing here runs DeepSpeed.

The experiments run the user's training code with the work dir as their working directory, so
what is found there is read as a run directory is (dtrain.rundir): no link followed, regular
files only, every read bounded; a file that fails that is treated as missing.

Layout (deepspeed/autotuning/autotuner.py, scheduler.py; DeepSpeed 0.19):

    autotuning_results/summary.txt              pipe table: tuning_space | num_experiments | best_metric_val | best_exp_name
    autotuning_results/ds_config_optimal.json   the best experiment's config, "autotuning" removed
    autotuning_results/cmd_optimal.txt          the best experiment's command line
    autotuning_results/<experiment>/{ds_config.json, exp.json, metrics.json, stderr.log, stdout.log, cmd.txt}
"""

from __future__ import annotations

import re
import stat
from typing import Any

from dtrain.errors import DTrainError
from dtrain.rundir import RunDir, UnsafeRunDir

MAX_JSON_BYTES = 1 << 20
MAX_LOG_BYTES = 4 << 20  # an experiment's stderr is scanned for errors up to this many bytes (its end)
ERROR_LINE = re.compile(r"error", re.IGNORECASE)  # DeepSpeed's own test (autotuning/utils.py search_error)


class AutotuneError(DTrainError):
    """Autotuning produced no usable result (every experiment failed, or DeepSpeed stopped early)."""


def _text(results: RunDir, *parts: str) -> str | None:
    raw = results.read(*parts, limit=MAX_JSON_BYTES)
    return None if raw is None else raw.decode("utf-8", "replace")


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


def experiment(results: RunDir, name: str) -> dict[str, Any]:
    """One experiment: its name, ds_config, metrics (when it finished) and first error lines."""
    out: dict[str, Any] = {"name": name}
    for key, file in (("metrics", "metrics.json"), ("model_info", "model_info.json"), ("ds_config", "ds_config.json")):
        value = results.read_json(name, file, limit=MAX_JSON_BYTES)
        if isinstance(value, dict):
            out[key] = value
    stderr, _ = results.read_end(name, "stderr.log", limit=MAX_LOG_BYTES)
    errors = [line for line in stderr.decode("utf-8", "replace").splitlines() if ERROR_LINE.search(line)]
    out["errors"] = errors[:5]
    out["status"] = "failed" if errors else "ok" if "metrics" in out or "model_info" in out else "no result"
    return out


def _experiments(results: RunDir) -> list[str]:
    return sorted(entry.name for entry in results.list() if entry.is_dir)


def experiment_ports(results_dir: str) -> list[int]:
    """The master port of every experiment (its exp.json), for cleaning up after them."""
    try:
        results = RunDir(results_dir)
        names = _experiments(results)
    except UnsafeRunDir:
        return []
    ports = []
    for name in names:
        exp = results.read_json(name, "exp.json", limit=MAX_JSON_BYTES)
        port = exp.get("master_port") if isinstance(exp, dict) else None
        if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
            ports.append(port)
    return ports


def read_results(results_dir: str) -> dict[str, Any]:
    """Everything the XCom hand-off needs; AutotuneError naming the failed experiments when no optimum exists."""
    results = RunDir(results_dir)
    info = results.stat()
    if info is None or not stat.S_ISDIR(info.st_mode):  # missing, or a link planted in its place
        raise AutotuneError(f"DeepSpeed wrote no {results_dir}: the autotuner did not start (see its output)")
    experiments = [experiment(results, name) for name in _experiments(results)]
    optimal = results.read_json("ds_config_optimal.json", limit=MAX_JSON_BYTES)
    if not isinstance(optimal, dict):
        failed = [e for e in experiments if e["status"] != "ok"] or experiments
        detail = "; ".join(f"{e['name']}: {(e['errors'] or [e['status']])[0][:300]}" for e in failed[:5])
        raise AutotuneError(f"DeepSpeed's autotuner found no runnable configuration ({len(experiments)} "
                            f"experiment(s)): {detail or 'none ran'}")
    summary_text = _text(results, "summary.txt") or ""
    rows = parse_summary(summary_text)
    best = next((r for r in rows if r.get("tuning_space") == "global"), rows[-1] if rows else {})
    cmd = _text(results, "cmd_optimal.txt")
    return {
        "optimal_config": optimal,
        "best_experiment": best.get("best_exp_name"),
        "best_metric_value": best.get("best_metric_val"),
        "summary": rows,
        "summary_text": summary_text,
        "cmd_optimal": cmd.strip() if cmd is not None else None,
        "experiments": [{k: e.get(k) for k in ("name", "status", "errors")}
                        | {"metric": (e.get("metrics") or {}).get("throughput")} for e in experiments],
        "results_dir": results_dir,
    }
