"""Credentials against a moto server that enforces them (IAM auth on, a separate process).

Bad credentials give a clear error; a profile from AWS_PROFILE + a credentials file works,
so the CLI honours the standard AWS environment.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dtrain.staging.engine import stage
from dtrain.staging.errors import StagingError

from .conftest import REGION, aws_env

BIN = os.path.dirname(sys.executable)


@pytest.mark.parametrize("client", ["native", "s3fs"])
def test_bad_credentials_give_a_clear_error(auth_server, tmp_path, monkeypatch, client):
    monkeypatch.setenv("DTRAIN_S3_CLIENT", client)
    endpoint, key_id, secret = auth_server
    aws_env(monkeypatch, endpoint)  # "testing"/"testing": unknown to this server
    with pytest.raises(StagingError, match="denied: check the credentials"):
        stage("s3://secured/ds/", str(tmp_path / "d"))
    assert not (tmp_path / "d" / "a.bin").exists()
    result = stage("s3://secured/ds/", str(tmp_path / "d"), storage_options={"key": key_id, "secret": secret})
    assert result.fetched == 1 and (tmp_path / "d" / "a.bin").read_bytes() == b"secret data"


def test_cli_uses_the_profile_named_by_aws_profile(auth_server, tmp_path):
    endpoint, key_id, secret = auth_server
    creds = tmp_path / "credentials"
    creds.write_text(f"[stager]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n"
                     "[wrong]\naws_access_key_id = AKIAWRONG\naws_secret_access_key = nope\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION=REGION, AWS_EC2_METADATA_DISABLED="true")
    argv = [os.path.join(BIN, "dtrain"), "stage", "s3://secured/ds/", str(tmp_path / "d")]
    bad = subprocess.run(argv, capture_output=True, text=True, env={**env, "AWS_PROFILE": "wrong"}, timeout=120)
    assert bad.returncode != 0 and "denied" in bad.stderr and "nope" not in bad.stderr
    good = subprocess.run(argv, capture_output=True, text=True, env={**env, "AWS_PROFILE": "stager"}, timeout=120)
    assert good.returncode == 0, good.stderr
    assert (tmp_path / "d" / "a.bin").read_bytes() == b"secret data"
    assert secret not in good.stderr + good.stdout
