"""Deliberately broken DAG file: proves the import-error check of the packaging tests sees errors."""

from airflow.sdk import DAG  # noqa: F401  (marks this file as a DAG file for Airflow's heuristic)

raise RuntimeError("deliberately broken DAG file (tests/packaging)")
