"""Every rank gets the full env contract, on 2 simulated nodes x 2 processes, through real torchrun agents."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from dtrain.launch.node.env_contract import contract_from_env

from tests.support import rank_records

from ..conftest import script


def test_env_contract_two_nodes_by_two(out_dir):
    lines = []
    spec = LaunchSpec(command=[script("dump_env.py")], nodes=2, procs_per_node=2, env={"OUT_DIR": out_dir})
    result = Launcher(spec, sink=lines.append).run()
    assert result.exit_code == 0, "\n".join(lines[-30:])
    records = rank_records(out_dir)
    assert sorted(records) == [0, 1, 2, 3]
    masters = {(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in records.values()}
    assert len(masters) == 1 and all(masters.pop())
    for rank, record in records.items():
        env = record["env"]
        assert env["WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert int(env["NODE_RANK"]) == rank // 2
        assert int(env["LOCAL_RANK"]) == rank % 2
        assert env["DTRAIN_RUN_DIR"] == result.run_dir
    # Output streams live, prefixed with node and rank.
    for rank in range(4):
        assert any(line.startswith(f"[node{rank // 2} rank{rank}] rank {rank} wrote") for line in lines)


def test_concurrent_jobs_use_different_rendezvous_ports(tmp_path):
    outs = [tmp_path / "a", tmp_path / "b"]
    results = []

    def run(out):
        out.mkdir()
        spec = LaunchSpec(command=[script("dump_env.py")], nodes=2, procs_per_node=1, env={"OUT_DIR": str(out)})
        results.append(Launcher(spec, sink=lambda line: None).run())

    threads = [threading.Thread(target=run, args=(out,)) for out in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [r.exit_code for r in results] == [0, 0]
    ports = [{rec["env"]["MASTER_PORT"] for rec in rank_records(str(out)).values()} for out in outs]
    assert all(len(p) == 1 for p in ports) and ports[0] != ports[1]


def test_mpi_variables_map_to_contract_per_process_and_per_node():
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1", "AZ_BATCH_MASTER_NODE": "10.0.0.4:6105"}
    assert contract_from_env(env) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "6105"}
    env.update(OMPI_COMM_WORLD_RANK="6")
    assert contract_from_env(env)["NODE_RANK"] == "1"  # 6 // 4, not OMPI_COMM_WORLD_NODE_RANK
    assert contract_from_env(env, mpi_per_node_launch=True)["NODE_RANK"] == "6"


def test_torchrun_group_rank_becomes_node_rank():
    assert contract_from_env({"RANK": "3", "WORLD_SIZE": "4", "GROUP_RANK": "1"}) == {"NODE_RANK": "1"}


def test_arguments_with_shell_metacharacters_reach_the_script_verbatim(out_dir, tmp_path):
    pwned = tmp_path / "pwned"
    hostile = [f"$(touch {pwned})", f"`touch {pwned}`", "a b", "; ls", "|&<>", "*", "'\"", "line\nbreak", "--flag=x y", ""]
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "dtrain"), "launch", "--nodes", "1", "--procs-per-node", "2",
         "--env", f"OUT_DIR={out_dir}", "--", script("dump_env.py"), *hostile],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = rank_records(out_dir)
    assert len(records) == 2
    assert all(r["argv"] == hostile for r in records.values())
    assert not pwned.exists()


def test_every_rank_line_reaches_the_cli_whole(tmp_path):
    """4 ranks x 3,000 lines through `dtrain launch`: no two lines glued, none lost or cut."""
    import re

    lines_per_rank = 3000
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "dtrain"), "launch", "--nodes", "2", "--procs-per-node", "2",
         "--run-dir", str(tmp_path / "run"), "--", script("chatty.py"), str(lines_per_rank)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pattern = re.compile(r"\[node\d rank(\d)\] chatty rank=(\d) line=(\d+) x{200} end")
    seen: dict[int, list[int]] = {r: [] for r in range(4)}
    for line in proc.stdout.splitlines():
        if "chatty" not in line:
            continue
        match = pattern.fullmatch(line)
        assert match and match.group(1) == match.group(2), f"a damaged line: {line[:300]!r}"
        seen[int(match.group(2))].append(int(match.group(3)))
    assert all(sorted(numbers) == list(range(lines_per_rank)) for numbers in seen.values())
