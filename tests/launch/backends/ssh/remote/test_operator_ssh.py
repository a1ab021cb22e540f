"""The operators over SSH in real Airflow, on hosts with their own addresses (tests/netcluster.py):
preflight on both hosts (each reporting its own interface toward node 0), then a 2x2 launch whose
hosts come from an Airflow SSH connection; a hostile UI param reaches the script verbatim."""

from __future__ import annotations

import json
import os

from tests.conftest import load_test_dag
from tests.remote_jobs import needs_sshd


@needs_sshd
def test_preflight_and_launch_over_ssh_from_an_airflow_connection(airflow_db, net_cluster, tmp_path, monkeypatch):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    pwned = tmp_path / "pwned"
    settings = net_cluster.ssh_settings()
    conn = {"conn_type": "ssh", "extra": {
        "hosts": [f"root@{h.line} slots=2" for h in net_cluster.hosts[:2]],
        "key_file": settings["key_file"], "known_hosts_file": settings["known_hosts_file"]}}
    monkeypatch.setenv("AIRFLOW_CONN_DTRAIN_SSH_TEST", json.dumps(conn))
    hostile = f"$(touch {pwned}); `touch {pwned}` 'x"
    dag = load_test_dag("ssh_operator_dags.py", "ssh_operator_test")
    run = dag.test(run_conf={"out_dir": str(out_dir), "hostile": hostile})
    states = {t.task_id: t.state for t in run.get_task_instances()}
    assert states == {"preflight": "success", "train": "success"}
    ti = next(t for t in run.get_task_instances() if t.task_id == "preflight")
    report = ti.xcom_pull(task_ids="preflight")
    assert report["ok"] and [n["node"] for n in report["nodes"]] == [0, 1]
    hosts = net_cluster.net.hosts[:2]
    assert [n["host"] for n in report["nodes"]] == [h.address for h in hosts]
    # node 0's first interface is a decoy: each node reports the one that reaches node 0
    assert [n["facts"]["socket_ifname"] for n in report["nodes"]] == [h.interface for h in hosts] == ["eth1", "eth0"]
    records = {}
    for name in os.listdir(out_dir):
        if name.startswith("rank"):
            record = json.loads((out_dir / name).read_text())
            records[int(record["env"]["RANK"])] = record
    assert sorted(records) == [0, 1, 2, 3]
    assert all(int(r["env"]["NODE_RANK"]) == rank // 2 for rank, r in records.items())
    assert all(r["argv"] == [hostile] for r in records.values())
    assert not pwned.exists()
