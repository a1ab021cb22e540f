"""``[core] hostname_callable`` of tests/deployment.py's components: the address of the host each runs on.

The namespace hosts share this machine's hostname (which resolves to 127.0.0.1), so Airflow's default
would name every worker the same; a real machine's own name would do what this does."""

import os


def address() -> str:
    return os.environ["DTRAIN_TEST_HOST_ADDRESS"]
