"""Airflow connections, read in one place: operators and the UI get credentials only through these.

* :mod:`dtrain.hooks.aws`: an AWS connection as s3fs storage options or the standard AWS variables
  (through the amazon provider's ``AwsBaseHook`` where it is installed);
* :mod:`dtrain.hooks.ssh`: an SSH connection, which the ssh backend turns into hosts and settings;
* :mod:`dtrain.hooks.mlflow`: an MLflow tracking server's address and sign-in.

Each reads its connection at execute time (never at DAG parse) and imports Airflow, the amazon
provider or boto3 inside its functions only. The hooks import nothing of the packages that use
them (staging, preprocess, launch, mlflow), so any of those can use any hook.
"""

from dtrain.errors import DTrainError


class ConnectionNotFound(DTrainError):
    """The Airflow connection a task names does not exist."""
