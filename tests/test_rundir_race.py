"""RunDir.ensure_dir when the nodes of one job create the same directory at once.

Every node of a detached ssh job makes ``detached/`` in the shared run directory as it starts; on
three namespace hosts one node lost the race (its open found nothing, the other node's mkdir came
first, its own mkdir raised FileExistsError) and failed its start. The race is made certain here by
letting "the other node" create the directory between the open and the mkdir."""

from __future__ import annotations

import os

from dtrain.rundir import RunDir


def test_a_directory_made_by_another_node_between_open_and_mkdir_is_used(tmp_path, monkeypatch):
    real_mkdir = os.mkdir
    raced = []

    def other_node_first(path, mode=0o777, *, dir_fd=None):
        if dir_fd is not None and path == "detached" and not raced:
            raced.append(path)
            real_mkdir(path, mode, dir_fd=dir_fd)  # the other node wins the race
        return real_mkdir(path, mode, dir_fd=dir_fd)

    run = RunDir(str(tmp_path / "run"))
    monkeypatch.setattr(os, "mkdir", other_node_first)
    run.ensure_dir("detached", "node1")
    monkeypatch.undo()
    assert raced == ["detached"]
    assert (tmp_path / "run" / "detached" / "node1").is_dir()


def test_nodes_starting_at_once_all_get_the_directory(tmp_path):
    # The real thing, less certain to race: many processes making the same tree at the same moment.
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(8)
    path = str(tmp_path / "run")

    def make(index):
        start.wait()
        RunDir(path).ensure_dir("detached", f"node{index % 2}")

    procs = [ctx.Process(target=make, args=(i,)) for i in range(8)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    assert [proc.exitcode for proc in procs] == [0] * 8
    assert sorted(os.listdir(os.path.join(path, "detached"))) == ["node0", "node1"]
