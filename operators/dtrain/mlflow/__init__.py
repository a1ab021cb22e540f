"""MLflow in the retraining pipeline: the model registry, the tracked train task, the UI's links.

* :mod:`dtrain.mlflow.registry`: :class:`~dtrain.mlflow.registry.MlflowRegistry`, MLflow's model
  registry as a pipeline's registry (docs/mlflow.md);
* :mod:`dtrain.mlflow.operator`: the pipeline's train task when its registry tracks runs;
* :mod:`dtrain.mlflow.tracking`: finding, resuming and logging a train task's run;
* :mod:`dtrain.mlflow.links`: checked links from the UI's pages to the tracking server.

The tracking server's connection is read by dtrain.hooks.mlflow. MLflow itself (``mlflow-skinny``,
the ``mlflow`` extra) is imported on first use, never on the DAG-parse path.
"""
