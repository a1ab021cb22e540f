"""The run-directory rule (docs/security.md): nothing in the package opens, lists, stats, writes or
removes a path under a run directory except through :mod:`dtrain.rundir`.

The scan finds every call of a file-system primitive in the modules that deal with run
directories. Each one must be in ALLOWED, with the reason it is not a run-directory path; a new
call fails this test until it goes through ``RunDir`` or is added here with its reason (reviewed).
A call whose path is literally ``os.devnull`` (a secret's stdin pointed at /dev/null once read) names
no run-directory path on its face, so the scan does not report it.
"""

from __future__ import annotations

import ast
import os
import sys

import dtrain

PACKAGE = os.path.dirname(dtrain.__file__)
#: the parts of the package that read or write run directories (staging and preprocess write
#: datasets through their own no-follow destinations, docs/staging.md)
SCANNED = ("launch", "ui", "autotune", "training", "pipeline", "mlflow", "preflight", "cli.py", "plugin.py",
           "stall_report.py")
#: calls that touch the file system
PRIMITIVES = {
    "open", "os.open", "io.open", "os.listdir", "os.scandir", "os.walk", "os.unlink", "os.remove",
    "os.rename", "os.replace", "os.stat", "os.lstat", "os.makedirs", "os.mkdir", "os.rmdir", "os.utime",
    "os.chmod", "os.symlink", "os.link", "os.truncate", "shutil.rmtree", "shutil.copy", "shutil.copyfile",
    "shutil.copy2", "shutil.move", "shutil.copytree", "glob.glob", "glob.iglob", "os.path.exists",
    "os.path.isfile", "os.path.isdir", "os.path.lexists", "os.path.islink", "os.path.getmtime",
    "os.path.getsize", "os.path.getctime", "json.load", "np.load", "torch.load", "torch.save",
    # dtrain.atomic's writers take a path like open() does
    "atomic_open", "atomic_write_bytes", "atomic.atomic_open", "atomic.atomic_write_bytes", "fsync_directory",
}

#: "module:function" -> why that call is not on a run-directory path (or why it is the rank's own)
ALLOWED = {
    # The rank's side: the training helper runs inside the user's (untrusted) rank and writes its own
    # files there (the launcher never reads through them: it reads with dtrain.rundir).
    "training/checkpoint.py:CheckpointManager.__init__": "the rank makes its own checkpoint directory",
    "training/checkpoint.py:CheckpointManager.save": "the rank saves its own checkpoint and pointer (torch.save)",
    "training/checkpoint.py:CheckpointManager.steps": "the rank lists its own checkpoints",
    "training/checkpoint.py:CheckpointManager.latest_path": "the rank reads its own pointer",
    "training/checkpoint.py:CheckpointManager._prune": "the rank removes its own old checkpoints",
    "training/checkpoint.py:CheckpointManager.load_latest": "the rank loads its own checkpoint",
    "training/checkpoint.py:CheckpointManager.load_deepspeed": "the rank lists its own DeepSpeed checkpoints",
    "training/ckpt_storage.py:LocalStorage.make_root": "the rank makes its own DCP checkpoint folder",
    "training/ckpt_storage.py:LocalStorage.names": "the rank lists its own DCP checkpoints (folders, no link followed)",
    "training/ckpt_storage.py:LocalStorage.read_small": "the rank reads its own commit marker (O_NOFOLLOW, bounded)",
    "training/ckpt_storage.py:LocalStorage.write_small": "the rank writes its own commit marker (O_EXCL temp + rename)",
    "training/ckpt_storage.py:LocalStorage.remove_file": "the rank removes its own old commit markers",
    "training/ckpt_storage.py:LocalStorage.remove_tree": "the rank removes its own old DCP checkpoints",
    "training/reference/train_digits.py:atomic_save": "the example script (a rank) writes its model",
    "training/reference/train_digits.py:main": "the example script reads its data and the DeepSpeed config",
    "training/reference/digits_eval.py:evaluate": "the user's evaluate reads the model file it is given",
    "training/shards.py:ShardDataset._map": "the staged dataset (staging's no-follow destination), not a run dir",
    "training/shards.py:ShardDataset._check_files": "the staged dataset",
    "training/shards.py:ShardDataset._read_into": "the staged dataset",
    "training/loop.py:TrainLoop.restore": "the rank loads the warm-start model it was given (--init-from)",
    # The launcher's side, on paths that are not under a run directory.
    "launch/backends/__init__.py:_group_may_be_declared": "the installed distributions' entry_points.txt on sys.path",
    "launch/backends/placement.py:visible_gpu_count": "/proc/driver/nvidia/gpus",
    "launch/core/spec.py:LaunchSpec.__post_init__": "the user's workdir exists (a spec check)",
    "launch/core/spec.py:LaunchSpec._check_command": "the user's script exists (a spec check)",
    "launch/core/deepspeed_config.py:load_deepspeed_config": "the user's DeepSpeed config file named in the spec",
    "launch/engine/options_doc.py:main": "the Markdown file holding the options tables (docs/backends.md)",
    "launch/node/ranklog.py:_open_append": "relative to the logs directory fd opened O_NOFOLLOW|O_DIRECTORY, O_NOFOLLOW",
    "launch/node/ranklog.py:RankLog.__init__": "opens the logs directory O_NOFOLLOW|O_DIRECTORY (fd-relative after)",
    "launch/node/ranklog.py:RankLog._rotate": "rename relative to the logs directory fd (never through a link)",
    "launch/node/ds_shm.py:unlink_ours": "DeepSpeed's /dev/shm buffers",
    "launch/node/torchrun_agent.py:main": "removes the agent's private log directory, made by tempfile.mkdtemp in the temp folder",
    "launch/node/agent_logs.py:pid_namespace": "/proc/self/ns/pid: the agent's pid namespace",
    "launch/node/agent_logs.py:sweep": "killed agents' private log directories in the temp folder (lstat: never a link)",
    "launch/node/proctree.py:environ_of": "/proc/PID/environ: a process's environment (read bounded)",
    "launch/node/ds_shm.py:release_ports": "DeepSpeed's /dev/shm buffers",
    "launch/backends/ssh/hostfile.py:SSHSettings._validated": "the user's ssh key and known_hosts paths exist",
    "launch/backends/ssh/control.py:_private_dir": "ssh control sockets: the job's own 0700 temp directory",
    "launch/backends/ssh/control.py:live_sockets": "ssh control sockets: the job's own 0700 temp directory",
    "launch/backends/ssh/control.py:remove_dir": "ssh control sockets: the job's own 0700 temp directory",
    "preflight/checks.py:file_sha256": "the staged dataset's files",
    "preflight/checks.py:infiniband_devices": "/sys/class/infiniband",
    "preflight/checks.py:check_node": "the staged dataset directory on the node",
    "pipeline/steps.py:evaluate_model": "the model path the pipeline computed ({output})",
    "pipeline/publish.py:_published_partitions": "the models root (written by publish, not by ranks)",
    "pipeline/publish.py:previous_published": "the models root",
    "pipeline/publish.py:_copy_model": "copies the model into publish's own temp directory",
    "pipeline/publish.py:publish_model": "publishes into the models root (own temp directory, renamed)",
    "autotune/cli.py:run": "the user's --output file",
    "mlflow/registry.py:_no_links": "the model path the pipeline computed ({output}): refuses links in it",
    "mlflow/registry.py:MlflowRegistry.warm_start": "the registry's download folder on the shared filesystem",
    "mlflow/registry.py:MlflowRegistry._download": "downloads into its own temp folder there, renamed",
    "mlflow/registry.py:_source_of": "an installed package's source on the worker (importlib's spec), not a run dir",
    "mlflow/registry.py:_artifact_source": "an artifact beside the model the pipeline computed ({output}): no part a link",
    "mlflow/registry.py:_copy_artifact": "that artifact, opened O_NOFOLLOW (a folder: its copy checked for links), into our own folder",
    "mlflow/tracking.py:write_json_artifact": "a JSON file in its own temp folder, uploaded as a run's artifact",
}


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _opens_devnull(call: ast.Call) -> bool:
    """Whether the call's path is ``os.devnull`` itself (no run-directory path can be)."""
    return bool(call.args) and _name(call.args[0]) == "os.devnull"


def file_system_calls() -> dict[str, list[int]]:
    """"module:qualified function" -> line numbers of file-system primitive calls in it."""
    found: dict[str, list[int]] = {}
    for top in SCANNED:
        root = os.path.join(PACKAGE, top)
        if not os.path.exists(root):
            continue
        paths = [root] if root.endswith(".py") else [os.path.join(d, f) for d, _, fs in os.walk(root)
                                                      for f in fs if f.endswith(".py")]
        for path in paths:
            rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            _visit(tree, rel, [], found)
    return found


def _visit(node: ast.AST, rel: str, scope: list[str], found: dict[str, list[int]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _visit(child, rel, [*scope, child.name], found)
            continue
        if isinstance(child, ast.Call) and _name(child.func) in PRIMITIVES and not _opens_devnull(child):
            found.setdefault(f"{rel}:{'.'.join(scope) or '<module>'}", []).append(child.lineno)
        _visit(child, rel, scope, found)


def test_run_directories_are_read_and_written_only_through_dtrain_rundir():
    calls = file_system_calls()
    unexplained = {where: lines for where, lines in calls.items() if where not in ALLOWED}
    assert not unexplained, (
        "file-system calls outside dtrain.rundir (go through dtrain.rundir.RunDir, or add the call to "
        f"ALLOWED with the reason it is not a run-directory path): {unexplained}")


def test_the_allow_list_has_no_stale_entries():
    stale = sorted(set(ALLOWED) - set(file_system_calls()))
    assert not stale, f"ALLOWED names calls that are gone: {stale}"


def test_the_scan_sees_a_planted_call(tmp_path, monkeypatch):
    # The scanner itself can fail: a module with an open() on a run-directory path is reported.
    module = tmp_path / "launch"
    module.mkdir()
    (module / "bad.py").write_text("import os\ndef read(run_dir):\n    return open(os.path.join(run_dir, 'x'))\n"
                                   "def quiet():\n    return os.open(os.devnull, os.O_RDONLY)\n"
                                   "def named_like_it(devnull):\n    return os.open(devnull, os.O_RDONLY)\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(tmp_path))
    assert file_system_calls() == {"launch/bad.py:read": [3], "launch/bad.py:named_like_it": [7]}
