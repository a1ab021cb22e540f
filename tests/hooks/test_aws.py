"""dtrain.hooks.aws: an Airflow AWS connection (given as AIRFLOW_CONN_<ID>) as s3fs storage options and
as the standard AWS variables, read through the amazon provider's AwsBaseHook where it is installed
and directly where it is not (its absence simulated: its module cannot be imported)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtrain.hooks.aws import aws_environment, aws_storage_options

PROVIDER_MODULE = "airflow.providers.amazon.aws.hooks.base_aws"
SECRET = "hook-secret-0123456789"
AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_PROFILE",
            "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE")


def provider_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(PROVIDER_MODULE) is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(params=["provider", "fallback"])
def reader(request, monkeypatch, tmp_path):
    """Which way the connection is read: through AwsBaseHook, or directly (the provider made
    unimportable). Nothing ambient: no AWS variables, no shared credentials files."""
    if request.param == "provider" and not provider_installed():
        pytest.skip("apache-airflow-providers-amazon is not installed: `pip install -e \".[test,amazon]\"` runs this path")
    if request.param == "fallback":
        monkeypatch.setitem(sys.modules, PROVIDER_MODULE, None)  # `import` of it raises ImportError
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return request.param


def connection(monkeypatch, conn_id: str, **fields) -> str:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "aws", **fields}))
    return conn_id


def test_both_readers_give_the_same_options_and_variables(reader, monkeypatch):
    conn_id = connection(monkeypatch, "dtrain_hook_aws", login="AKIAHOOKTEST", password=SECRET, extra={
        "aws_session_token": "token-123456", "endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-3",
        "profile_name": "team"})
    assert aws_storage_options(conn_id) == {
        "key": "AKIAHOOKTEST", "secret": SECRET, "token": "token-123456", "endpoint_url": "http://127.0.0.1:9",
        "client_kwargs": {"region_name": "eu-west-3"}, "profile": "team"}
    assert aws_environment(conn_id) == {
        "AWS_ACCESS_KEY_ID": "AKIAHOOKTEST", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": "token-123456",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_PROFILE": "team", "AWS_DEFAULT_REGION": "eu-west-3"}


def test_an_s3_endpoint_in_service_config_is_the_endpoint(reader, monkeypatch):
    conn_id = connection(monkeypatch, "dtrain_hook_svc", extra={"service_config": {"s3": {"endpoint_url": "http://s3.internal"}}})
    assert aws_storage_options(conn_id) == {"endpoint_url": "http://s3.internal"}


def test_a_missing_connection_fails_except_aws_default(reader, monkeypatch):
    from dtrain.hooks import ConnectionNotFound

    monkeypatch.delenv("AIRFLOW_CONN_AWS_DEFAULT", raising=False)
    monkeypatch.delenv("AIRFLOW_CONN_DTRAIN_NO_SUCH_AWS", raising=False)
    assert aws_storage_options("aws_default") == {} and aws_environment("aws_default") == {}
    with pytest.raises(ConnectionNotFound, match="'dtrain_no_such_aws' not found"):
        aws_storage_options("dtrain_no_such_aws")


def test_the_hooks_import_nothing_heavy_at_dag_parse():
    # What a DAG file imports with the operators: no boto3/botocore, no amazon provider's hooks (Airflow
    # itself reads every provider's get_provider_info), no mlflow.
    code = ("import sys, json; import dtrain.hooks.aws, dtrain.hooks.ssh, dtrain.hooks.mlflow, "
            "dtrain.staging.operator, dtrain.preprocess.operator, dtrain.launch.airflow.operator; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 's3fs', "
            "'mlflow') or m.startswith('airflow.providers.amazon.aws'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _read_through(options: dict, bucket: str, key: str) -> bytes:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **options).cat(f"{bucket}/{key}")


def test_s3fs_reaches_moto_through_the_connections_endpoint(reader, s3_bucket, moto_endpoint, monkeypatch, tmp_path):
    import boto3

    boto3.client("s3").put_object(Bucket=s3_bucket, Key="train/a.bin", Body=b"staged bytes")
    # From here on only the connection says where S3 is and who we are (the fixture's variables go).
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    conn_id = connection(monkeypatch, "dtrain_hook_moto", login="testing", password="testing",
                         extra={"endpoint_url": moto_endpoint, "region_name": "us-east-1"})
    options = aws_storage_options(conn_id)
    assert options["endpoint_url"] == moto_endpoint
    assert _read_through(options, s3_bucket, "train/a.bin") == b"staged bytes"


def test_a_role_arn_is_assumed_and_the_roles_credentials_reach_s3(reader, s3_bucket, moto_endpoint, monkeypatch):
    import boto3

    if reader == "fallback":
        pytest.skip("role_arn is the amazon provider's: without it the connection's own credentials are used")
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="m.bin", Body=b"via role")
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    conn_id = connection(monkeypatch, "dtrain_hook_role", login="testing", password="testing", extra={
        "role_arn": "arn:aws:iam::123456789012:role/dtrain-stage", "region_name": "us-east-1",
        "endpoint_url": moto_endpoint, "service_config": {"sts": {"endpoint_url": moto_endpoint}}})
    options = aws_storage_options(conn_id)
    # moto's STS hands out the assumed role's temporary credentials: not the connection's own
    assert options["key"] != "testing" and options["token"] and "profile" not in options
    assert aws_environment(conn_id)["AWS_SESSION_TOKEN"]
    assert _read_through(options, s3_bucket, "m.bin") == b"via role"
