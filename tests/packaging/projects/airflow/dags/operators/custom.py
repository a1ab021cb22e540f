class CustomThing:
    """A trivial class of the user's, imported by user_dag.py."""

    SOURCE = "dags"
