"""The user's own ``operators`` package in the DAGs folder."""

SOURCE = "dags"
