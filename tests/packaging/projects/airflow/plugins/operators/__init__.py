"""The user's own ``operators`` package in the plugins folder (Airflow puts this folder on sys.path).

It also has ``custom.py``: two plain packages named ``operators`` (this one and dags/operators)
shadow each other whatever dtrain does, so each holds the module the user's DAG imports.
"""

SOURCE = "plugins"
