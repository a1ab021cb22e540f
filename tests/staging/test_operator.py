"""StageToSharedFSOperator in real Airflow (dag.test() on SQLite) against moto, with the
credentials in an Airflow connection given as AIRFLOW_CONN_<ID> (JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import datetime, timezone

import pytest

from dtrain.staging import manifest as M

from .conftest import wait_for

AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN")


STAGE_DAG = """
from airflow.sdk import DAG, Param
from dtrain.staging.operator import StageToSharedFSOperator

with DAG(dag_id="stage_operator_test", schedule=None, catchup=False,
         params={"prefix": Param("ds", type="string"), "fsx": Param("/nonexistent", type="string")}) as dag:
    StageToSharedFSOperator(task_id="stage", source="s3://secured/{{ params.prefix }}/",
                            destination="{{ params.fsx }}", aws_conn_id="stage_s3", epoch_seconds="60",
                            nodes="2", deployment_type="SCRATCH_2", progress_interval=0.01)
"""


def stage_dag(tmp_path, monkeypatch):
    """The DAG above, written by the test into its own DAG bundle (Airflow 3.3's dag.test()
    runs only DAGs it finds serialized from a configured bundle); listed first so dag.test()
    finds it without parsing other bundles."""
    import importlib.util

    folder = tmp_path / "dags"
    folder.mkdir()
    (folder / "stage_operator_dag.py").write_text(STAGE_DAG)
    bundles = json.loads(os.environ.get("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST") or "[]")
    bundles = [b for b in bundles if b.get("name") != "staging-test"]
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps(
        [{"name": "staging-test", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
          "kwargs": {"path": str(folder)}}] + bundles))
    spec = importlib.util.spec_from_file_location("stage_operator_dag", folder / "stage_operator_dag.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


def test_operator_stages_with_connection_credentials_keyed_by_logical_date(airflow_db, auth_server, tmp_path,
                                                                            monkeypatch, capfd):
    endpoint, key_id, secret = auth_server
    for name in AWS_VARS:  # nothing ambient: the connection is the only way in
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AIRFLOW_CONN_STAGE_S3", json.dumps({
        "conn_type": "aws", "login": key_id, "password": secret,
        "extra": {"endpoint_url": endpoint, "region_name": "us-east-1"}}))
    fsx = tmp_path / "fsx"
    dag = stage_dag(tmp_path, monkeypatch)
    dag_run = dag.test(logical_date=datetime(2024, 5, 1, tzinfo=timezone.utc), run_conf={"fsx": str(fsx)})
    ti = next(t for t in dag_run.get_task_instances() if t.task_id == "stage")
    assert ti.state == "success"
    xcom = ti.xcom_pull(task_ids="stage")
    dest = fsx / "2024-05-01"  # keyed by the logical date ({{ ds }})
    assert xcom["destination"] == str(dest) and xcom["manifest_path"] == str(dest / M.MANIFEST_NAME)
    assert (xcom["fetched"], xcom["files_total"], xcom["bytes_fetched"]) == (1, 1, len(b"secret data"))
    assert xcom["throughput"]["required_mbps"] == pytest.approx(11 / 1e6 / 60, abs=0.1)
    assert xcom["throughput"]["ok"] in (True, False) and xcom["throughput"]["options"][0]["capacity_tib"] == 1.2
    assert (dest / "a.bin").read_bytes() == b"secret data"
    out = capfd.readouterr()
    assert "fetched 1, skipped 0" in out.out + out.err  # the engine's summary reached the task log
    assert secret not in json.dumps(xcom) and secret not in out.out + out.err
    # Another logical date (a backfill) lands in its own directory, never in this one.
    dag_run = dag.test(logical_date=datetime(2024, 5, 2, tzinfo=timezone.utc), run_conf={"fsx": str(fsx)})
    assert (fsx / "2024-05-02" / "a.bin").exists() and sorted(os.listdir(fsx)) == ["2024-05-01", "2024-05-02"]


def test_operator_fails_the_task_with_a_wrong_connection(airflow_db, auth_server, tmp_path, monkeypatch):
    endpoint, _key_id, _secret = auth_server
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_STAGE_S3", json.dumps({
        "conn_type": "aws", "login": "AKIAWRONG", "password": "wrong-secret", "extra": {"endpoint_url": endpoint}}))
    dag = stage_dag(tmp_path, monkeypatch)
    dag_run = dag.test(logical_date=datetime(2024, 6, 1, tzinfo=timezone.utc), run_conf={"fsx": str(tmp_path / "f")})
    ti = next(t for t in dag_run.get_task_instances() if t.task_id == "stage")
    assert ti.state == "failed"
    assert not (tmp_path / "f" / "2024-06-01" / "a.bin").exists()


def test_operator_bad_dataset_version_fails_before_any_io(tmp_path):
    from dtrain.errors import SpecError
    from dtrain.staging.operator import StageToSharedFSOperator

    op = StageToSharedFSOperator(task_id="s", source="s3://b/p/", destination=str(tmp_path / "fsx"),
                                 dataset_version="../escape", aws_conn_id=None)
    with pytest.raises(SpecError, match="dataset_version"):
        op.execute({})
    assert not (tmp_path / "fsx").exists()


def test_on_kill_cancels_and_leaves_no_temporary_file(s3, proxy, tmp_path, monkeypatch):
    from dtrain.staging.errors import StagingCancelled
    from dtrain.staging.operator import StageToSharedFSOperator

    endpoint, faults = proxy
    s3.put_many({f"p/{i}.bin": os.urandom(400_000) for i in range(6)})
    faults.bytes_per_second = 500_000
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    op = StageToSharedFSOperator(task_id="s", source=s3.url("p/"), destination=str(tmp_path / "fsx"),
                                 dataset_version="v1", aws_conn_id=None, workers=2, part_size="256KiB")
    errors = []

    def run():
        try:
            op.execute({})
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    dest = tmp_path / "fsx" / "v1"
    wait_for(lambda: any(n.startswith(M.TMP_PREFIX) for n in (os.listdir(dest) if dest.exists() else [])),
             what="a temp file being written")
    op.on_kill()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], StagingCancelled)
    assert not [n for n in os.listdir(dest) if n.startswith(M.TMP_PREFIX)]
    assert not (dest / M.MANIFEST_NAME).exists()


def test_operator_module_is_cheap_to_import_and_init_does_no_io(tmp_path):
    code = (
        "import sys\n"
        "from dtrain.staging.operator import StageToSharedFSOperator\n"
        f"op = StageToSharedFSOperator(task_id='s', source='s3://b/{{{{ ds }}}}/', destination={str(tmp_path / 'x')!r})\n"
        "heavy = [m for m in ('s3fs', 'boto3', 'botocore', 'aiobotocore', 'torch', 'numpy') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert not (tmp_path / "x").exists()
