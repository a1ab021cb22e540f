"""Preemption: on SIGTERM every rank finishes its step, the ranks agree on the step to stop at, a
checkpoint for that step is saved within the grace period, the job exits 143; a relaunch with
the same run directory resumes from that step, not from the last periodic checkpoint.

* The helper alone (dtrain.training.preemption): SIGTERM only records a request; nothing else
  happens until the loop asks; two real gloo ranks agree on the step when only one got the
  signal; a rank whose peer is gone still exits at once.
* End to end with real processes: ``dtrain launch`` (local 1x2; ssh 2x2 on two sshd "hosts")
  runs the reference script with a checkpoint every 20 steps; it is SIGTERMed between two
  periodic checkpoints (as Airflow stops a task, or a spot instance is reclaimed); the
  checkpoint of the step it stopped at exists, and the relaunch resumes from it.
* The grace period reaches every backend's stop path (rendered argv, agents' env, handles),
  and is spent only while a process of the job still runs.

The old code fails the end-to-end tests: SIGTERM killed the ranks at once, so the newest
checkpoint was the periodic one (step 20) and nothing said "preempted".
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dtrain.launch.core.spec import LaunchSpec
from tests.remote_jobs import needs_sshd  # the fixtures ssh_cluster and slurm: tests/services.py
from tests.support import wait_for

pytestmark = pytest.mark.timeout(300)

DTRAIN = os.path.join(os.path.dirname(sys.executable), "dtrain")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
TRAIN = ["python", "-m", "dtrain.training.reference.train_digits"]
EVERY = 20  # periodic checkpoint interval
STOP_AFTER = 25  # SIGTERM once rank 0 logged this step: between the checkpoints of steps 20 and 40
EPOCHS = 2  # a node: 22 steps an epoch at world size 2 (batch 32 a rank), 11 at world size 4
STEPS = 44  # EPOCHS x nodes epochs


def env_without_job() -> dict[str, str]:
    """This environment minus any DTRAIN_* a surrounding job might have set."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DTRAIN_") or k == "DTRAIN_HOME"}


# -- the helper on its own --------------------------------------------------------------------

@pytest.fixture
def guard():
    from dtrain.training.preemption import PreemptionGuard

    previous = signal.getsignal(signal.SIGTERM)
    g = PreemptionGuard(announce=False)
    try:
        yield g
    finally:
        g.uninstall()
        assert signal.getsignal(signal.SIGTERM) == previous


def deliver(signum: int) -> None:
    """Send ``signum`` to this process and let the interpreter run its Python handler."""
    os.kill(os.getpid(), signum)
    for _ in range(50):  # the handler runs between two bytecodes of the main thread
        time.sleep(0.002)


def test_sigterm_only_records_a_request_until_the_loop_asks(guard, monkeypatch):
    monkeypatch.setenv("DTRAIN_STOP_GRACE", "12.5")
    assert not guard.stop_requested() and not guard.should_stop()
    before = time.monotonic()
    deliver(signal.SIGTERM)  # the process is still here: the default action (death) is gone
    request = guard.request
    assert guard.stop_requested() and request.signum == signal.SIGTERM and request.received_at >= before
    assert request.grace == 12.5 and 0 < guard.time_left() <= 12.5
    deliver(signal.SIGTERM)  # a job gets SIGTERM from several senders: the first one counts
    assert guard.request is request
    assert guard.should_stop() and guard.should_stop()  # no process group: the local flag decides
    assert guard.exit_code == 143 and not guard.peers_lost

    from dtrain.training import PreemptionGuard, stop_requested  # exported by the training package

    assert isinstance(guard, PreemptionGuard) and stop_requested()


def test_sigint_keeps_its_keyboard_interrupt_unless_asked_for():
    from dtrain.training.preemption import PreemptionGuard

    # Python's own SIGINT handler, whatever an earlier test in this process left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        guard = PreemptionGuard(announce=False)
        try:
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            with pytest.raises(KeyboardInterrupt):
                deliver(signal.SIGINT)
            assert not guard.stop_requested()
        finally:
            guard.uninstall()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_guard_must_be_installed_from_the_main_thread():
    import threading

    from dtrain.training.preemption import PreemptionGuard

    errors = []
    thread = threading.Thread(target=lambda: errors.append(_try(PreemptionGuard)))
    thread.start()
    thread.join()
    assert isinstance(errors[0], RuntimeError) and "main thread" in str(errors[0])


def _try(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (returned to the test)
        return e
    return None


LOOP = textwrap.dedent("""
    import sys, time
    from dtrain.training.preemption import PreemptionGuard
    guard = PreemptionGuard()
    for step in range(1, 200):
        print(f"step {step} started", flush=True)
        time.sleep(0.3)  # a step: the signal arrives in the middle of one
        print(f"step {step} done", flush=True)
        if guard.should_stop():
            print(f"stopping after step {step}", flush=True)
            sys.exit(guard.exit_code)
""")


def test_a_process_finishes_its_step_then_exits_143(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", LOOP], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_without_job(), cwd=REPO)
    try:
        for line in proc.stdout:
            if line.strip() == "step 3 started":
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert "step 3 done\nstopping after step 3\n" in out  # the step it was in finished, no further one
    assert "SIGTERM received: stopping after the current step" in err


AGREE = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    from dtrain.training.preemption import PreemptionGuard
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    guard = PreemptionGuard(announce=False)
    out = sys.argv[1]
    step, agreed = 0, False
    try:
        while step < 500:
            t = torch.ones(4)
            dist.all_reduce(t)  # the training step's collective
            time.sleep(0.1 if rank == 0 else 0.3)  # rank 1 is slower: its signal lands mid-step
            step += 1
            open(os.path.join(out, f"rank{rank}.step"), "w").write(str(step))
            if guard.should_stop():
                agreed = not guard.peers_lost
                break
    except Exception as e:
        print(f"rank {rank} error: {e}", flush=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"step": step, "requested": guard.stop_requested(), "peers_lost": guard.peers_lost,
                   "signal": guard.request and guard.request.signum}, fh)
    if not agreed:
        guard.exit()  # a peer is gone: no process-group teardown
    dist.destroy_process_group()  # as the reference script does after an agreed stop
    sys.exit(guard.exit_code)
""")


def start_pair(tmp_path) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = dict(env_without_job(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                   RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen([sys.executable, "-c", AGREE, str(tmp_path)], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def stop_pair(procs) -> list[str]:
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=60)[0])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


def step_of(tmp_path, rank: int) -> int:
    try:
        return int((tmp_path / f"rank{rank}.step").read_text() or 0)
    except (OSError, ValueError):
        return 0


def test_ranks_agree_on_the_step_when_only_one_got_the_signal(tmp_path):
    procs = start_pair(tmp_path)
    try:
        wait_for(lambda: step_of(tmp_path, 1) >= 3, timeout=120, what="both ranks training")
        procs[1].send_signal(signal.SIGTERM)  # rank 0 never gets a signal
    finally:
        outs = stop_pair(procs)
    assert [p.returncode for p in procs] == [143, 143], outs
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["step"] == r1["step"] >= 3  # the same step on both: no rank left in a collective
    assert r1["requested"] and r1["signal"] == signal.SIGTERM and r0["requested"]  # rank 0 learnt it from rank 1
    assert not r0["peers_lost"] and not r1["peers_lost"]


def test_a_rank_whose_peer_is_gone_still_exits_at_once(tmp_path):
    procs = start_pair(tmp_path)
    try:
        wait_for(lambda: step_of(tmp_path, 0) >= 3, timeout=120, what="both ranks training")
        procs[1].send_signal(signal.SIGSTOP)  # frozen: rank 0 waits for it in the next collective
        procs[0].send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert procs[0].poll() is None  # still waiting: its peer holds the connection open
        procs[1].kill()  # killed outright: it never agrees on anything
        started = time.monotonic()
        procs[0].wait(timeout=30)
        took = time.monotonic() - started
    finally:
        outs = stop_pair(procs)
    assert procs[0].returncode == 143, outs[0]
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["requested"]
    assert report["peers_lost"] or "error" in outs[0]  # the agreement (or the step's collective) failed
    assert took < 20, took  # no wait for a peer that will never answer


# -- the grace period in every backend's stop path ----------------------------------------------

def test_local_backend_gives_agents_and_supervisor_the_grace(tmp_path):
    from dtrain.launch.backends.local import LocalBackend
    from dtrain.launch.core.job import prepare_job

    spec = LaunchSpec(command=["python", "-c", "pass"], nodes=2, stop_grace=12.5, run_dir=str(tmp_path / "run"))
    backend = LocalBackend(sink=lambda line: None)
    request = backend.dryrun(prepare_job(spec, create=False))
    assert request.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "13"  # torchrun takes whole seconds: rounded up
    assert request.env["DTRAIN_STOP_GRACE"] == "12.5"
    overridden = LocalBackend(sink=lambda line: None, grace_seconds=2)
    assert overridden.dryrun(prepare_job(spec, create=False)).env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "2"


def test_ssh_backend_renders_the_grace_into_both_node_commands(tmp_path):
    import shlex

    from dtrain.launch.backends.ssh import SSHBackend
    from dtrain.launch.core.job import prepare_job

    spec = LaunchSpec(command=["train.py"], nodes=2, backend="ssh", device="cpu", stop_grace=45, rdzv_port=29500,
                      run_dir=str(tmp_path / "run"), backend_options={"hosts": ["h1 slots=1", "h2 slots=1"]})
    job = prepare_job(spec, create=False)
    for detached, module in ((False, "dtrain.launch.backends.ssh.remote_agent"),
                             (True, "dtrain.launch.backends.ssh.detached_node")):
        request = SSHBackend(sink=lambda line: None).dryrun(job, detached=detached)
        for i, argv in enumerate(request.argvs):
            remote = shlex.split(argv[-1])
            assert remote[1:3] == ["-m", module]
            options = remote[:remote.index("--")]
            assert options[options.index("--grace") + 1] == "45"
            env = json.loads(request.stdin[i])["env"]
            assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "45" and env["DTRAIN_STOP_GRACE"] == "45"


def test_slurm_script_exports_the_grace_and_cancel_signals_before_it_cancels(tmp_path):
    from dtrain.launch.backends.slurm import render as R
    from dtrain.launch.core.job import Job

    spec = LaunchSpec(command=["train.py"], nodes=2, backend="slurm", device="cpu", stop_grace=90)
    text = R.render_sbatch(Job(spec=spec, job_id="j", run_dir="/r/j", rank_env={}), R.SlurmOptions(python="/py"),
                           workdir="/w")
    assert "\nexport DTRAIN_STOP_GRACE=90\n" in text and "\nexport TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90\n" in text
    assert R.signal_argv("42") == ["scancel", "--signal=TERM", "42"]  # steps only: the batch script is spared
    assert R.running_steps("42.0\n42.batch\n42.extern\n") == ["42.0"]
    assert R.running_steps("42.batch\n") == []


def test_slurm_waits_for_new_exit_records_of_every_rank(tmp_path):
    from dtrain.launch.core.exits import exit_records, ranks_exited_since

    exits = tmp_path / "exits"
    exits.mkdir()
    (exits / "rank0.restart0.json").write_text("{}")  # an earlier attempt's record
    before = exit_records(str(tmp_path))
    (exits / "rank1.restart1.json").write_text("{}")
    assert not ranks_exited_since(before, exit_records(str(tmp_path)), 2)
    time.sleep(0.01)
    (exits / "rank0.restart1.json").write_text("{}")
    assert ranks_exited_since(before, exit_records(str(tmp_path)), 2)


HANG_IGNORING_TERM = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank that never stops on its own
    open(os.path.join(sys.argv[1], f"up{os.environ['RANK']}"), "w").close()
    time.sleep(600)
""")


def test_failure_teardown_spends_no_grace_on_ranks_already_gone(tmp_path):
    """stop_grace=120: a rank fails, the other dies on SIGTERM at once: the job ends long before
    the grace period would (the wait ends when the last process is gone)."""
    from dtrain.launch.engine.launcher import Launcher

    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n    time.sleep(2); sys.exit(5)\n"
                      "time.sleep(600)\n")
    spec = LaunchSpec(command=[str(script)], nodes=1, procs_per_node=2, device="cpu", stop_grace=120,
                      run_dir=str(tmp_path / "run"))
    started = time.monotonic()
    result = Launcher(spec, sink=lambda line: None).run()
    assert result.exit_code == 5 and result.failed_rank == 1
    assert time.monotonic() - started < 60


def test_cancel_with_a_short_grace_overrides_the_spec(tmp_path):
    """A rank that ignores SIGTERM: the spec's 120 s would be waited in full; cancel(grace=1) (what a
    hang teardown uses) kills it after about a second."""
    import threading

    from dtrain.launch.backends.local import LocalBackend
    from dtrain.launch.core.job import prepare_job

    script = tmp_path / "stubborn.py"
    script.write_text(HANG_IGNORING_TERM)
    spec = LaunchSpec(command=[str(script), str(tmp_path)], nodes=1, procs_per_node=2, device="cpu",
                      stop_grace=120, run_dir=str(tmp_path / "run"))
    backend = LocalBackend(sink=lambda line: None)
    handle = backend.submit(prepare_job(spec))
    try:
        wait_for(lambda: (tmp_path / "up0").exists() and (tmp_path / "up1").exists(), timeout=120, what="ranks up")
        assert backend.supervisor.grace_seconds == 120
        pids = backend.pids()
        started = time.monotonic()
        worker = threading.Thread(target=backend.cancel, args=(handle,), kwargs={"grace": 1.0})
        worker.start()
        worker.join(timeout=60)
        took = time.monotonic() - started
    finally:
        backend.cancel(handle, grace=0)
    assert not worker.is_alive() and took < 30, took
    from tests.support import alive

    assert alive(pids) == []


# -- every backend waits the grace period for a slow save ----------------------------------------

SLOW_SAVE = textwrap.dedent("""
    import os, signal, sys, time
    run, rank = os.environ["DTRAIN_RUN_DIR"], os.environ["RANK"]
    saving = []
    def on_term(signum, frame):
        if saving:
            return  # SIGTERM comes from several senders: one save
        saving.append(signum)
        time.sleep(float(sys.argv[1]))  # a checkpoint that takes a while to write
        with open(os.path.join(run, f"saved{rank}"), "w") as fh:
            fh.write(os.environ.get("DTRAIN_STOP_GRACE", "?"))
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(run, f"up{rank}"), "w").close()
    time.sleep(600)
""")
SAVE_SECONDS = 8  # longer than the old 5 s between SIGTERM and SIGKILL


def stop_during_slow_save(tmp_path, spec_kwargs: dict) -> tuple[object, list[str], float]:
    import threading

    from dtrain.launch.engine.launcher import Launcher

    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE)
    run_dir = tmp_path / "run"
    spec = LaunchSpec(command=["python", str(script), str(SAVE_SECONDS)], procs_per_node=2, device="cpu",
                      stop_grace=40, run_dir=str(run_dir), **spec_kwargs)
    lines: list[str] = []
    launcher = Launcher(spec, sink=lines.append)
    results = []
    runner = threading.Thread(target=lambda: results.append(launcher.run()))
    runner.start()
    world = spec.world_size
    try:
        wait_for(lambda: all((run_dir / f"up{r}").exists() for r in range(world)) or not runner.is_alive(),
                 timeout=180, what="every rank up")
        assert runner.is_alive(), lines[-30:]
        started = time.monotonic()
        launcher.terminate()
        runner.join(timeout=120)
        took = time.monotonic() - started
    finally:
        if runner.is_alive():
            launcher.terminate()
            runner.join(timeout=60)
    assert results and results[0].exit_code == 143 and results[0].stopped, lines[-30:]
    saved = {r: (run_dir / f"saved{r}").read_text() if (run_dir / f"saved{r}").exists() else None
             for r in range(world)}
    assert saved == {r: "40" for r in range(world)}, (saved, lines[-30:])  # every rank finished its save
    exits = [json.loads(p.read_text()) for p in (run_dir / "exits").glob("rank*.json")]
    assert sorted(r["exit_code"] for r in exits) == [143] * world, exits  # none was SIGKILLed (137)
    return results[0], lines, took


def test_local_stop_waits_the_grace_for_a_slow_save(tmp_path):
    _, _, took = stop_during_slow_save(tmp_path, {"nodes": 1})
    assert SAVE_SECONDS <= took < 40  # waited for the save, and no longer than it took


@needs_sshd
def test_ssh_stop_waits_the_grace_for_a_slow_save(ssh_cluster, tmp_path):
    _, _, took = stop_during_slow_save(tmp_path, {
        "nodes": 2, "backend": "ssh",
        "backend_options": {"hostfile": ssh_cluster.hostfile(2), **ssh_cluster.ssh_settings()}})
    assert SAVE_SECONDS <= took < 40


def test_slurm_stop_waits_the_grace_for_a_slow_save(slurm, tmp_path):
    """Slurm's own cancel would SIGKILL after KillWait (2 s on the test cluster): the backend first
    sends SIGTERM to the job's steps and waits for the ranks, then cancels."""
    from tests.launch.backends.slurm.conftest import queue

    result, lines, took = stop_during_slow_save(tmp_path, {
        "nodes": 2, "backend": "slurm", "workdir": REPO,
        "backend_options": {"poll_interval": 0.3}})
    assert SAVE_SECONDS <= took < 60
    assert queue(slurm) == []


# -- end to end: SIGTERM between two checkpoints, then the relaunch ------------------------------

def last_step(run_dir, rank: int = 0) -> int:
    path = os.path.join(run_dir, "metrics", f"rank{rank}.jsonl")
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [line for line in fh.read().splitlines() if line.strip()]
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def launch_argv(run_dir, *launch_args: str, step_sleep: float | None, nodes: int = 1, epochs: int | None = None,
                deepspeed: bool = False) -> list[str]:
    train = [*TRAIN, "--epochs", str(epochs or EPOCHS * nodes), "--checkpoint-every", str(EVERY)]
    if deepspeed:
        train.append("--deepspeed")
    if step_sleep:
        train += ["--step-sleep", str(step_sleep)]
    return [DTRAIN, "launch", "--nodes", str(nodes), "--procs-per-node", "2", "--device", "cpu",
            "--run-dir", str(run_dir), "--stop-grace", "25", *launch_args, "--", *train]


def preempt_and_resume(tmp_path, launch_args: list[str], nodes: int, **train) -> None:
    run_dir = tmp_path / "run"
    log_path = tmp_path / "launch.log"
    with open(log_path, "wb") as log:
        cli = subprocess.Popen(launch_argv(run_dir, *launch_args, step_sleep=0.4, nodes=nodes, **train), stdout=log,
                               stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        ok = wait_for(lambda: last_step(run_dir) >= STOP_AFTER or cli.poll() is not None, timeout=240,
                      what=f"step {STOP_AFTER}")
        assert ok and cli.poll() is None, log_path.read_text()[-3000:]
        cli.send_signal(signal.SIGTERM)  # what Airflow sends a task it stops
        code = cli.wait(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    log = log_path.read_text()
    assert code == 143, log[-3000:]
    saved = [line for line in log.splitlines() if "preempted: checkpoint saved at step" in line]
    assert len(saved) == 1 and saved[0].startswith("[node0 rank0] "), log[-3000:]
    step = int(saved[0].rsplit(" ", 1)[1])
    assert EVERY < step < 2 * EVERY, log[-3000:]  # between two periodic checkpoints: a save of its own
    checkpoints = run_dir / "checkpoints"
    if train.get("deepspeed"):  # every rank wrote its shards, DeepSpeed its own pointer
        assert (checkpoints / "deepspeed" / f"step-{step:08d}").is_dir()
        assert (checkpoints / "deepspeed" / "latest").read_text().strip() == f"step-{step:08d}"
    else:
        assert (checkpoints / f"step-{step:08d}.pt").is_file()
        assert (checkpoints / "latest").read_text().strip() == f"step-{step:08d}.pt"
    # Every rank stopped by itself (143), none was killed (137) at the end of the grace period.
    exits = {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in (run_dir / "exits").glob("rank*.json")}
    assert sorted(exits) == list(range(2 * nodes)), exits
    assert {r["exit_code"] for r in exits.values()} == {143}, exits
    # Every rank logged exactly the steps up to the one it stopped at.
    assert {last_step(run_dir, r) for r in range(2 * nodes)} == {step}

    relaunch = subprocess.run(launch_argv(run_dir, *launch_args, step_sleep=None, nodes=nodes, **train), cwd=REPO,
                              capture_output=True, text=True, timeout=240)
    out = relaunch.stdout + relaunch.stderr
    assert relaunch.returncode == 0, out[-3000:]
    assert f"resumed from checkpoint at step {step}" in out
    result = json.loads((run_dir / "metrics" / "result.json").read_text())
    assert result["resumed_from_step"] == step and result["steps"] == STEPS


@needs_sshd
def test_ssh_sigterm_between_checkpoints_saves_that_step_and_the_relaunch_resumes_from_it(ssh_cluster, tmp_path):
    backend = ["--backend", "ssh", "--hostfile", ssh_cluster.hostfile(2), "--ssh-key", ssh_cluster.key_file,
               "--ssh-known-hosts", ssh_cluster.known_hosts, "--ssh-strict-host-key-checking", "yes"]
    preempt_and_resume(tmp_path, backend, nodes=2)


def test_slurm_sigterm_between_checkpoints_saves_that_step_and_the_relaunch_resumes_from_it(slurm, tmp_path):
    from tests.launch.backends.slurm.conftest import queue

    preempt_and_resume(tmp_path, ["--backend", "slurm", "--slurm-poll-interval", "0.3"], nodes=2)
    assert queue(slurm) == []
