"""Staging: mirror a dataset from object storage onto the shared filesystem, and size that filesystem.

Airflow-free engine (``engine.stage``), throughput planner (``planner``), a thin
Airflow operator (``operator.StageToSharedFSOperator``) and the ``dtrain stage`` /
``dtrain plan`` subcommands (``cli``). Importing this package imports nothing heavy:
s3fs/boto3 are imported inside the functions that talk to storage.
"""
