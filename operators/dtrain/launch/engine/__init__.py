"""The launcher, with or without Airflow: spec, job, launcher, exits, hang watch, torchrun argv,
node supervision, CLI (the rules: dtrain/launch/__init__.py)."""
