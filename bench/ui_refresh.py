"""The Training tab's cost to Airflow's API server while a big job is watched: the code of `main` (or
``--base``) against this tree's.

A job of ``--ranks`` ranks whose metrics files are at the size cap (16 MiB a rank) and growing (a
few lines a second a rank, as a training loop logs them) is watched for ``--seconds`` the way the
page watches it: every 2 s after the previous refresh, the summary, the three plots and the log
tails. The API server is Airflow's real app (core API and plugins, as `airflow api-server` builds
it, served in process as tests/ui does), over a real task instance: a 1-rank job run by dag.test()
with this tree's operator (so its run directory carries the launcher's marker). Each code base is
measured in its own process (its RSS is its own), the compared one's taken from `git archive
<--base>` (default main).
Prints one line: RSS at the start, the end and the peak, and seconds per refresh, for both, with
their ratios. Goal: flat RSS, under 1 s a refresh.

    .venv/bin/python bench/ui_refresh.py [--ranks 8] [--seconds 120] [--rss-limit-mb 6000] [--base main]

With ``--plot-ranks N`` it prints another line instead: one plot of N ranks drawn a line per rank
against the ranks' envelope (min/median/max per step), the tab's drawing beyond 16 ranks:

    .venv/bin/python bench/ui_refresh.py --plot-ranks 512

With ``--planted N`` it prints the summary's cost when a rank filled ``metrics/`` with N files,
``--base``'s code against this tree's:

    .venv/bin/python bench/ui_refresh.py --planted 300000 --base <the commit to compare with>

``--rss-limit-mb``: a process past it is stopped and reported as such (code that keeps a
parsed copy of every rank file per refresh: on a shared machine it would take all the memory).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
DAG_ID = "bench_ui"
#: the size cap of a rank's metrics file read whole (dtrain.rundir.MAX_METRICS_BYTES)
CAP = 16 * 1024 * 1024
DAG_FILE = f'''
from airflow.sdk import DAG
from dtrain.launch.airflow.operator import DistributedTrainingOperator

with DAG(dag_id="{DAG_ID}", schedule=None, catchup=False) as dag:
    DistributedTrainingOperator(task_id="train", command=["python", "-c", "pass"], nodes=1, procs_per_node=1,
                                device="cpu", hang_timeout=None, retries=0)
'''


def record(rank: int, step: int) -> bytes:
    """One metrics line as dtrain.training.MetricsWriter writes it."""
    wait = 0.004 + 0.001 * (rank % 3)
    return (json.dumps({"step": step, "epoch": step // 1000, "loss": 2.0 / (1 + step * 1e-3) + rank * 1e-3,
                        "samples": 64, "step_time_s": 0.1125, "data_wait_s": wait, "samples_per_s": 568.889,
                        "time": 1.7e9 + step * 0.1125}) + "\n").encode()


def fill(metrics: str, ranks: int) -> int:
    """Rank files at the cap (each replaced: a fresh inode); returns the next step to log."""
    os.makedirs(metrics, exist_ok=True)
    steps = CAP // len(record(0, 10**6))
    for rank in range(ranks):
        tmp = os.path.join(metrics, f".rank{rank}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(b"".join(record(rank, step) for step in range(1, steps + 1)))
        os.replace(tmp, os.path.join(metrics, f"rank{rank}.jsonl"))
    return steps + 1


class Growth(threading.Thread):
    """Appends ``per_second`` lines a second to every rank file, as ranks log steps."""

    def __init__(self, metrics: str, ranks: int, first_step: int, per_second: int = 4):
        super().__init__(daemon=True)
        self.metrics, self.ranks, self.step, self.per_second = metrics, ranks, first_step, per_second
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0 / self.per_second):
            for rank in range(self.ranks):
                with open(os.path.join(self.metrics, f"rank{rank}.jsonl"), "ab") as fh:
                    fh.write(record(rank, self.step))
            self.step += 1


def environment(home: str) -> dict[str, str]:
    bundle = os.path.join(home, "dags")
    return dict(os.environ, AIRFLOW_HOME=os.path.join(home, "airflow"), DTRAIN_HOME=os.path.join(home, "dtrain"),
                AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CORE__UNIT_TEST_MODE="False",
                AIRFLOW__CORE__DAGS_FOLDER=bundle, AIRFLOW__CORE__PLUGINS_FOLDER=os.path.join(REPO, "plugins"),
                AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST=json.dumps([{
                    "name": "bench", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
                    "kwargs": {"path": bundle}}]),
                PATH=BIN + os.pathsep + os.environ.get("PATH", ""), OMP_NUM_THREADS="1")


def set_up(home: str) -> str:
    """A migrated DB and one finished run of the 1-rank DAG (this tree's code); its run id."""
    env = environment(home) | {"PYTHONPATH": os.pathsep.join([os.path.join(REPO, "operators"), REPO])}
    os.makedirs(os.path.join(home, "dags"))
    with open(os.path.join(home, "dags", "bench_ui.py"), "w") as fh:
        fh.write(DAG_FILE)
    subprocess.run([os.path.join(BIN, "airflow"), "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=600)
    script = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('b', sys.argv[1]); "
              "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); r = m.dag.test(); "
              "print('RUN_ID', r.run_id, r.state)")
    out = subprocess.run([sys.executable, "-c", script, os.path.join(home, "dags", "bench_ui.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    found = [line.split() for line in out.stdout.splitlines() if line.startswith("RUN_ID ")]
    if out.returncode != 0 or not found or found[-1][2] != "success":
        raise SystemExit(f"setting up the watched job failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return found[-1][1]


def old_tree(home: str, base: str) -> str:
    """The package as commit ``base`` has it, from git: the code to compare with."""
    where = os.path.join(home, "base")
    os.makedirs(where)
    archive = subprocess.run(["git", "-C", REPO, "archive", base, "operators"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", where], input=archive.stdout, check=True)
    return os.path.join(where, "operators")


def measure(home: str, package: str, run_id: str, args) -> dict:
    """Serve and watch in a child process running ``package``; its result."""
    env = environment(home) | {"PYTHONPATH": os.pathsep.join([package, REPO])}
    (run_dir,) = glob.glob(os.path.join(home, "dtrain", "runs", DAG_ID, "*", "train"))  # the one run's
    metrics_dir = os.path.join(run_dir, "metrics")
    growth = Growth(metrics_dir, args.ranks, fill(metrics_dir, args.ranks))
    growth.start()
    try:
        out = subprocess.run([sys.executable, __file__, "--watch", run_id, "--seconds", str(args.seconds),
                              "--rss-limit-mb", str(args.rss_limit_mb)], env=env, capture_output=True, text=True,
                             timeout=args.seconds + 900)
    finally:
        growth.stop.set()
        growth.join()
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"the watch failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(lines[-1])


# -- the watching process ----------------------------------------------------------------------------

def watch(run_id: str, seconds: float, rss_limit_mb: float) -> None:
    """Build the API app, then refresh as the page does for ``seconds``; print one JSON line."""
    import psutil

    me = psutil.Process()
    peak = [0]
    stopped = threading.Event()
    result: dict = {}

    def sample() -> None:
        while not stopped.wait(0.1):
            rss = me.memory_info().rss
            peak[0] = max(peak[0], rss)
            if rss > rss_limit_mb * 2**20:
                result.update(stopped_at_mb=round(rss / 2**20))
                print(json.dumps(summary(result, times, cpu, start_rss, rss, peak[0])), flush=True)
                os._exit(0)

    from fastapi.testclient import TestClient

    from airflow.api_fastapi import app as api_app
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from airflow.configuration import conf

    conf.set("core", "auth_manager", "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager")
    conf.set("core", "simple_auth_manager_users", "admin:admin")
    conf.set("api_auth", "jwt_secret", os.urandom(48).hex())
    client = TestClient(api_app.create_app("core"))
    token = api_app.get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    headers = {"Authorization": f"Bearer {token}"}
    query = {"dag_id": DAG_ID, "run_id": run_id, "task_id": "train", "map_index": "-1"}
    paths = ["/dtrain/api/ti/summary"] + [f"/dtrain/api/ti/plot/{c}.svg" for c in
                                          ("loss", "samples_per_s", "data_wait_fraction")] + ["/dtrain/api/ti/logs"]
    client.get("/dtrain/static/training.js", headers=headers)  # the app built, its plugin mounted
    times: list[float] = []
    cpu: list[float] = []
    start_rss = me.memory_info().rss
    threading.Thread(target=sample, daemon=True).start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started, started_cpu = time.perf_counter(), time.process_time()
        for path in paths:
            response = client.get(path, params=query, headers=headers)
            if response.status_code != 200:
                raise SystemExit(f"{path}: {response.status_code} {response.text[:500]}")
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
        result.setdefault("rss_warm_mb", round(me.memory_info().rss / 2**20))  # after the first refresh
        time.sleep(2.0)
    stopped.set()
    print(json.dumps(summary(result, times, cpu, start_rss, me.memory_info().rss, peak[0])), flush=True)


def summary(result: dict, times: list[float], cpu: list[float], start: int, end: int, peak: int) -> dict:
    mb = 2**20
    return {**result, "rss_start_mb": round(start / mb), "rss_end_mb": round(end / mb),
            "rss_peak_mb": round(max(peak, end) / mb), "refreshes": len(times),
            "s_per_refresh": round(statistics.mean(times), 3) if times else None,
            "s_per_refresh_median": round(statistics.median(times), 3) if times else None,
            "s_per_refresh_max": round(max(times), 3) if times else None,
            "cpu_per_refresh_s": round(statistics.mean(cpu), 3) if cpu else None,
            "cpu_per_refresh_median_s": round(statistics.median(cpu), 3) if cpu else None}


def describe(name: str, r: dict) -> str:
    stopped = f", STOPPED at {r['stopped_at_mb']} MB" if "stopped_at_mb" in r else ""
    per = "-" if r["s_per_refresh"] is None else f"{r['s_per_refresh']:.3f}"
    return (f"{name}: RSS {r['rss_start_mb']}/{r.get('rss_warm_mb', '-')}/{r['rss_end_mb']}/{r['rss_peak_mb']} MB "
            f"(start/after the first refresh/end/peak), {per} s/refresh (median {r['s_per_refresh_median']}, max "
            f"{r['s_per_refresh_max']}; CPU mean {r['cpu_per_refresh_s']} s, median {r['cpu_per_refresh_median_s']} s; "
            f"{r['refreshes']} refreshes){stopped}")


def plot_lines_vs_envelope(ranks: int, repeat: int = 3) -> None:
    """One Training-tab plot (loss) of ``ranks`` ranks, each with as many steps as the tab keeps of it
    (dtrain.ui.metrics_cache.MAX_RUN_RECORDS shared by the ranks): drawn a line per rank (as up to
    dtrain.ui.plots.MAX_RANK_LINES ranks are) and as the ranks' envelope (as more are). Prints the
    median of ``repeat`` draws of each, and the ratio."""
    sys.path.insert(0, os.path.join(REPO, "operators"))
    from dtrain.ui import plots, training
    from dtrain.ui.metrics_cache import MAX_RUN_RECORDS, parse

    steps = MAX_RUN_RECORDS // ranks
    metrics = {rank: [parse(record(rank, step)) for step in range(1, steps + 1)] for rank in range(ranks)}
    points = training.plot_points(training.curves(metrics)["loss"])
    plots.rank_curves("loss", "Loss", "loss", {"0": [[1, 1.0]]})  # matplotlib's import and fonts: not measured

    def seconds(max_lines: int) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            plots.rank_curves("loss", "Loss", "loss", points, max_lines=max_lines)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    lines, band = seconds(ranks), seconds(plots.MAX_RANK_LINES)
    print(f"Training-tab plot, {ranks} ranks x {len(points['0'])} points: a line per rank {lines:.3f} s, "
          f"envelope (min/median/max) {band:.3f} s, ratio {lines / band:.1f}x (median of {repeat}; goal: < 1 s)")


def planted_summary(planted: int, base: str, ranks: int = 8) -> None:
    """The Training tab's summary (provenance check, metrics, verdicts, exits, checkpoints) of a run
    directory whose ``metrics/`` holds ``ranks`` rank files and ``planted`` files a rank made, computed
    by ``base``'s code and by this tree's, each in its own process (its peak RSS its own)."""
    home = tempfile.mkdtemp(prefix="bench-ui-planted-")
    try:
        run_dir = os.path.join(home, "runs", DAG_ID, "r1", "train")
        metrics = os.path.join(run_dir, "metrics")
        os.makedirs(metrics)
        for rank in range(ranks):
            with open(os.path.join(metrics, f"rank{rank}.jsonl"), "wb") as fh:
                fh.write(b"".join(record(rank, step) for step in range(1, 101)))
        for i in range(planted):
            open(os.path.join(metrics, f"planted{i}"), "wb").close()
        results = {}
        for name, package in ((base, old_tree(home, base)), ("this tree", os.path.join(REPO, "operators"))):
            out = subprocess.run([sys.executable, __file__, "--summarize", run_dir], capture_output=True, text=True,
                                 env=os.environ | {"PYTHONPATH": package}, timeout=1800)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if not lines:
                raise SystemExit(f"{name} failed ({out.returncode}):\n{out.stderr[-4000:]}")
            results[name] = json.loads(lines[-1])
    finally:
        shutil.rmtree(home, ignore_errors=True)
    old, new = results[base], results["this tree"]
    print(f"Training-tab summary, {ranks} ranks + {planted} planted files in metrics/: {base} {old['s']:.3f} s "
          f"(peak RSS growth {old['rss_growth_mb']} MB), this tree {new['s']:.3f} s (peak RSS growth "
          f"{new['rss_growth_mb']} MB; unread: {new['unread']}), ratio {old['s'] / new['s']:.1f}x (median of 3)")


def summarize_planted(run_dir: str, repeat: int = 3) -> None:
    """In a process running one code base: the summary of ``run_dir`` ``repeat`` times; one JSON line."""
    import resource

    from dtrain.ui import metrics_cache, training

    try:
        from dtrain.rundir import write_marker
        from dtrain.ui.provenance import trusted_run_dir
    except ImportError:  # a --base from before the marker's writer moved beside the run directory's files
        from dtrain.provenance import trusted_run_dir, write_marker

    ti = {"dag_id": DAG_ID, "run_id": "r1", "task_id": "train", "map_index": -1, "try_number": 1}
    write_marker(run_dir, type("TI", (), ti))
    root = os.path.dirname(os.path.dirname(os.path.dirname(run_dir)))
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, view = [], {}
    for _ in range(repeat):
        started = time.perf_counter()
        run = trusted_run_dir(run_dir, ti, [root])
        view = training.job_view(ti=ti, record={"run_dir": run_dir}, result=None, hang=None, run=run,
                                 metrics=metrics_cache.follow(run).records)
        times.append(time.perf_counter() - started)
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_rss) // 1024
    print(json.dumps({"s": statistics.median(times), "rss_growth_mb": growth,
                      "unread": [u["message"] for u in view.get("unread", [])]}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--rss-limit-mb", type=float, default=6000)
    parser.add_argument("--base", default="main", help="the commit whose code is compared (default main; "
                                                        "to compare with main itself, the commit before it)")
    parser.add_argument("--plot-ranks", type=int, metavar="N",
                        help="instead: one plot of N ranks, a line per rank against their envelope (same data)")
    parser.add_argument("--planted", type=int, metavar="N",
                        help="instead: the summary of a run whose metrics/ a rank filled with N files, --base's "
                             "code vs this tree's")
    parser.add_argument("--watch", help=argparse.SUPPRESS)
    parser.add_argument("--summarize", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.summarize:
        summarize_planted(args.summarize)
        return
    if args.planted:
        planted_summary(args.planted, args.base)
        return
    if args.watch:
        watch(args.watch, args.seconds, args.rss_limit_mb)
        return
    if args.plot_ranks:
        plot_lines_vs_envelope(args.plot_ranks)
        return
    home = tempfile.mkdtemp(prefix="bench-ui-")
    try:
        run_id = set_up(home)
        old = measure(home, old_tree(home, args.base), run_id, args)
        new = measure(home, os.path.join(REPO, "operators"), run_id, args)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    per = (f"{old['s_per_refresh'] / new['s_per_refresh']:.1f}x"
           if old["s_per_refresh"] and new["s_per_refresh"] else "-")
    growth = (f"{(old['rss_peak_mb'] - old['rss_start_mb']) / max(1, new['rss_peak_mb'] - new['rss_start_mb']):.1f}x")
    print(f"Training tab, {args.ranks} ranks x 16 MiB metrics growing, watched {args.seconds:g} s: "
          f"{describe(args.base, old)}; {describe('this tree', new)}; ratio {args.base}/this: s/refresh {per}, "
          f"peak RSS growth {growth} (goal: flat RSS, < 1 s/refresh)")


if __name__ == "__main__":
    main()
