"""Preflight on every node (real subprocess per simulated node): pass, and each way to fail fast."""

from __future__ import annotations

import json

import pytest

from dtrain.launch.backends import resolve_placement
from dtrain.preflight.checks import check_node, file_sha256, nccl_env
from dtrain.preflight.runner import run_preflight

@pytest.fixture
def manifest(tmp_path):
    path = tmp_path / "staged" / "manifest.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"files": {"a.bin": {"size": 3}}}))
    return str(path)


def test_every_node_ready(manifest, tmp_path):
    report = run_preflight(resolve_placement(nodes=2, procs_per_node=2, device="cpu"),
                           manifest_path=manifest, manifest_sha256=file_sha256(manifest),
                           checkpoint_dir=str(tmp_path / "ckpt"), min_free_gb=0.001)
    assert report["ok"], report["summary"]
    assert [n["node"] for n in report["nodes"]] == [0, 1]
    assert report["nccl_env"] == {"NCCL_IB_DISABLE": "1"}
    assert [n["facts"]["socket_ifname"] for n in report["nodes"]] == ["lo", "lo"]  # every node is this host
    assert report["summary"][0] == "preflight: 2/2 node(s) ready"
    assert all(" iface=lo -> ok" in line for line in report["summary"][1:3])


@pytest.mark.parametrize("case, problem", [
    ("missing_manifest", "not visible"),
    ("changed_manifest", "differs from the one staging wrote"),
    ("no_disk", "free for checkpoints"),
    ("no_gpus", "GPU(s) visible"),
])
def test_each_problem_fails_with_a_clear_summary(manifest, tmp_path, case, problem):
    kwargs = {"manifest_path": manifest, "manifest_sha256": file_sha256(manifest),
              "checkpoint_dir": str(tmp_path), "min_free_gb": 0.001, "expect_gpus": False}
    if case == "missing_manifest":
        kwargs["manifest_path"] = str(tmp_path / "nope" / "manifest.json")
    elif case == "changed_manifest":
        kwargs["manifest_sha256"] = "0" * 64
    elif case == "no_disk":
        kwargs["min_free_gb"] = 10**9
    elif case == "no_gpus":
        kwargs["expect_gpus"] = True
    report = run_preflight(resolve_placement(nodes=2, procs_per_node=2, device="cpu"), **kwargs)
    assert not report["ok"]
    assert all(problem in " ".join(n["problems"]) for n in report["nodes"])
    assert "FAILED" in "\n".join(report["summary"])


def test_nccl_settings_follow_infiniband():
    assert nccl_env(["mlx5_0", "mlx5_1"]) == {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5_0,mlx5_1"}
    assert nccl_env([]) == {"NCCL_IB_DISABLE": "1"}  # the socket interface is each node's own choice


def test_a_node_without_a_route_to_node_0_is_not_ready():
    report = check_node(master_addr="no-such-host.invalid")
    assert not report["ok"] and report["facts"]["socket_ifname"] is None
    assert report["problems"] == ["no route from this node to node 0 at no-such-host.invalid (MASTER_ADDR): "
                                  "the ranks could not rendezvous"]
