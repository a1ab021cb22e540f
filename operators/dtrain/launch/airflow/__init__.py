"""What runs in an Airflow worker or triggerer: the training operator, its links, deferrable and
durable mode, the trigger, the retry policy (the rules: dtrain/launch/__init__.py)."""
