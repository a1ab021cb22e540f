"""The launcher, with or without Airflow: launcher, following a submitted job, hang watch, retry
classification, stragglers, CLI; it builds on core/ (the rules: dtrain/launch/__init__.py)."""
