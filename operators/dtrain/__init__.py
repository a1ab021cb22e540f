"""airflow-dtrain: Airflow operators and Airflow-free engines for distributed training pipelines.

Importing this package is cheap: no torch, deepspeed, s3fs or boto3 at module
level anywhere on the DAG-parse path. Heavy libraries are imported inside the
functions that use them.
"""

__version__ = "0.1.0"
