"""The retraining pipeline's own steps (configuration, evaluation, publishing), Airflow-free."""
