"""What runs beside the ranks, possibly on a host without Airflow: rank wrapper, torchrun agent,
rank logs, hang files, process tree, DeepSpeed shm clean-up (the rules: dtrain/launch/__init__.py)."""
