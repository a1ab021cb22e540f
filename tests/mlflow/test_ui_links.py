"""What the Retraining page and the Training tab show of MLflow: the registered version and alias per
run, links to the MLflow run and model version built from the tracking server's connection (never
from a recorded value), and an empty plot without a 1970-01-01 axis."""

from __future__ import annotations

from dtrain.ui import plots


def test_the_empty_partition_plot_has_no_date_axis():
    svg = plots.partition_metric("dag", "rmse", [])
    assert "no evaluated run yet" in svg and "1970" not in svg
    drawn = plots.partition_metric("dag", "rmse", [{"partition": "2026-03-01", "value": 0.5, "published": True}])
    assert "2026-03-01" in drawn


def test_links_lead_only_to_the_configured_server_whatever_was_recorded():
    from dtrain.mlflow.links import registered, run_link

    base, run_id = "http://mlflow.internal:5000", "a" * 32
    good = {"registry": "mlflow", "model_name": "tabular rmse", "version": "3", "alias": "champion",
            "mlflow_run_id": run_id, "experiment_id": "7"}
    shown = registered(base, good)
    assert shown["version_url"] == f"{base}/#/models/tabular%20rmse/versions/3"
    assert shown["run"] == {"run_id": run_id, "url": f"{base}/#/experiments/7/runs/{run_id}"}
    # A publish result rewritten through the REST API (XComs can be PATCHed) links nowhere else.
    for field, value in (("version", "3/../../../evil"), ("model_name", "x/../../y"), ("alias", "javascript:x"),
                         ("version", 3), ("registry", "directory")):
        assert registered(base, {**good, field: value}) is None, (field, value)
    assert registered(base, {**good, "mlflow_run_id": "http://evil.example/"})["run"] is None
    assert run_link(base, {"run_id": run_id, "experiment_id": "7/../../x"}) is None
    assert registered(None, good)["version_url"] == ""  # no connection configured: ids shown, no link


def test_the_retraining_view_carries_what_an_mlflow_publish_registered():
    from dtrain.ui.retraining import pipeline_view

    published = {"registry": "mlflow", "model_name": "m", "version": "2", "alias": "challenger",
                 "mlflow_run_id": "b" * 32, "experiment_id": "1"}
    runs = [{"run_id": "r2", "partition": "2026-03-02", "state": "success", "published": published,
             "decision": {"publish": True, "metric": "rmse", "goal": "minimize", "value": 0.4}},
            {"run_id": "r1", "partition": "2026-03-01", "state": "success",
             "published": {"model_path": "/m/model.pt", "metrics_path": "/m/metrics.json"},
             "decision": {"publish": True, "metric": "rmse", "goal": "minimize", "value": 0.5}}]
    view = pipeline_view("dag", runs, lambda path, partition: None, "http://127.0.0.1:5000")
    mlflow_row, directory_row = view["runs"]
    assert (mlflow_row["registered"]["version"], mlflow_row["registered"]["alias"]) == ("2", "challenger")
    assert directory_row["registered"] is None and directory_row["model_path"] == "/m/model.pt"


def test_dag_parsing_with_an_mlflow_registry_imports_no_mlflow():
    from tests.support import heavy_libraries_imported_by

    # what a DAG file with registry=MlflowRegistry(...) imports, and the operator its train task is
    assert heavy_libraries_imported_by("dtrain.mlflow.registry", "dtrain.mlflow.operator",
                                       "dtrain.pipeline.factory") == []


def test_a_registry_is_checked_when_the_dag_is_built():
    import pytest

    from dtrain.errors import SpecError
    from dtrain.mlflow.registry import MlflowRegistry

    for kwargs, field in (({"champion": "latest"}, "registry champion"), ({"challenger": "v2"}, "registry challenger"),
                          ({"champion": "x", "challenger": "x"}, "registry challenger"),
                          ({"tracking_uri": "file:///tmp/mlruns"}, "registry tracking_uri"),
                          ({"conn_id": None}, "registry conn_id"), ({"load_model": "not a path"}, "registry load_model")):
        with pytest.raises(SpecError) as refused:
            MlflowRegistry("m", **kwargs)
        assert refused.value.field == field, kwargs
    with pytest.raises(SpecError, match="registry model_name"):
        MlflowRegistry("it's")
