"""An Airflow AWS connection as s3fs storage options, or as the standard AWS variables.

Staging, preprocessing, the pipeline's raw-data listing and the ranks' checkpoints on S3 all get
their credentials here, and nowhere else.

Where the amazon provider is installed (``pip install "airflow-dtrain[amazon]"``), the connection
is read through its ``AwsBaseHook``, the way the team's other AWS tasks read it: credentials from
login/password or the extra, ``role_arn`` (the role is assumed, and its temporary credentials are
what s3fs and the ranks get), ``region_name``, ``endpoint_url`` or
``service_config.s3.endpoint_url``, ``profile_name``. Without the provider, the same fields
(except ``role_arn``) are read from the connection directly. Either way the result has the same
shape. Airflow, the provider and boto3 are imported inside the functions, at execute time.

A connection that does not exist fails the task, except ``aws_default``: without it, the worker's
own AWS environment (instance role, variables, shared files) is used. Secrets are never logged.
"""

from __future__ import annotations

from typing import Any

from dtrain.hooks import ConnectionNotFound

DEFAULT_CONN_ID = "aws_default"
#: storage options' keys -> the standard variables botocore and s3fs read
AWS_ENV_NAMES = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN",
                 "endpoint_url": "AWS_ENDPOINT_URL", "profile": "AWS_PROFILE"}


def _options(key: Any, secret: Any, token: Any, endpoint: Any, region: Any, profile: Any) -> dict[str, Any]:
    """s3fs storage options from the connection's fields (empty ones left out)."""
    options: dict[str, Any] = {}
    for name, value in (("key", key), ("secret", secret), ("token", token), ("endpoint_url", endpoint)):
        if value:
            options[name] = value
    if region:
        options["client_kwargs"] = {"region_name": region}
    if profile:
        options["profile"] = profile
    return options


def _missing(conn_id: str, log: Any, error: BaseException | None) -> dict[str, Any]:
    """No such connection: ``aws_default`` falls back to the worker's AWS environment, any other fails."""
    if conn_id == DEFAULT_CONN_ID:
        if log is not None:
            log.info("no connection %r: using the worker's AWS environment", conn_id)
        return {}
    reason = f": {type(error).__name__}" if error is not None else ""
    raise ConnectionNotFound(f"Airflow connection {conn_id!r} not found{reason}") from error


def _through_provider(conn_id: str, log: Any) -> dict[str, Any] | None:
    """The connection read by the amazon provider's AwsBaseHook; None when the provider is not installed."""
    try:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    except ImportError:
        return None
    hook = AwsBaseHook(aws_conn_id=conn_id, client_type="s3")
    config = hook.conn_config  # the hook reads the connection once and keeps it
    if not isinstance(config.conn_id, str):  # the hook found no such connection
        return _missing(conn_id, log, None)
    key, secret, token = config.aws_access_key_id, config.aws_secret_access_key, config.aws_session_token
    profile = config.profile_name
    if config.role_arn:
        # The hook assumes the role (from the connection's own credentials or profile); what s3fs and
        # the ranks need is the role's credentials, not the ones it was assumed with.
        credentials = hook.get_credentials()
        key, secret, token, profile = credentials.access_key, credentials.secret_key, credentials.token, None
    return _options(key, secret, token, config.get_service_endpoint_url("s3"), config.region_name, profile)


def _direct(conn_id: str, log: Any) -> dict[str, Any]:
    """The connection's fields read directly (no amazon provider): login, password and the extra."""
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as e:  # noqa: BLE001 - Airflow raises its own not-found type
        return _missing(conn_id, log, e)
    extra = conn.extra_dejson or {}
    endpoint = extra.get("endpoint_url") or (extra.get("service_config", {}).get("s3", {}) or {}).get("endpoint_url")
    return _options(conn.login, conn.password, extra.get("aws_session_token"), endpoint, extra.get("region_name"),
                    extra.get("profile_name"))


def aws_storage_options(conn_id: str, log: Any = None) -> dict[str, Any]:
    """s3fs storage options from Airflow AWS connection ``conn_id``: ``key``, ``secret``, ``token``,
    ``endpoint_url``, ``profile`` and ``client_kwargs.region_name``, each only when the connection
    gives it (an empty dict: the worker's own AWS environment). Secrets included: never log the result."""
    options = _through_provider(conn_id, log)
    return _direct(conn_id, log) if options is None else options


def aws_environment(conn_id: str, log: Any = None) -> dict[str, str]:
    """An Airflow AWS connection as the standard AWS variables (for a process started elsewhere: a
    worker pool, a training rank). Secrets included: never log or template the result."""
    options = aws_storage_options(conn_id, log)
    env = {AWS_ENV_NAMES[k]: str(v) for k, v in options.items() if k in AWS_ENV_NAMES}
    region = (options.get("client_kwargs") or {}).get("region_name")
    if region:
        env["AWS_DEFAULT_REGION"] = region
    return env
