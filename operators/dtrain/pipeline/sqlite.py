"""SQLite connection arguments for single-machine Airflow deployments (the demo, the tests).

With SQLite every writer takes the whole database: under load the scheduler can hold it
longer than sqlite3's 5-second default wait, and a CLI write (``airflow backfill create``)
then fails with "database is locked". Point Airflow at a longer wait:

    AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS=dtrain.pipeline.sqlite.CONNECT_ARGS
    AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC=dtrain.pipeline.sqlite.CONNECT_ARGS
"""

CONNECT_ARGS = {"timeout": 60}
