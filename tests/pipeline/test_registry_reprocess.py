"""The directory registry keeps the promise of the README's ``{init_from}``: a reprocessed old date
starts from, and is gated against, the model published just before its date, never a newer one.
(MlflowRegistry's same test runs against a real server: tests/mlflow/test_registry.py.)"""

from __future__ import annotations

from dtrain.pipeline.registry import DirectoryRegistry, Pipeline, RunRef


def publish(registry, tmp_path, partition: str, weights: bytes, rmse: float, clear_number: int = 0) -> None:
    model = tmp_path / "runs" / f"{partition}-{clear_number}" / "model.pt"
    model.parent.mkdir(parents=True)
    model.write_bytes(weights)
    run = RunRef(run_id=f"scheduled__{partition}", clear_number=clear_number, version="v1", partition=partition)
    registry.publish(run, str(model), {"evaluation": {"rmse": rmse}})


def test_a_reprocessed_old_date_starts_from_and_is_gated_against_the_model_published_before_it(tmp_path):
    registry = DirectoryRegistry(str(tmp_path / "models")).for_pipeline(
        Pipeline(dag_id="p", shared_fs=str(tmp_path / "fsx"), model_name="model.pt"))
    publish(registry, tmp_path, "2026-03-01", b"march 1", 0.5)
    publish(registry, tmp_path, "2026-03-04", b"march 4", 0.2)

    assert registry.warm_start("v1", "2026-03-01") == "" and registry.baseline("v1", "2026-03-01") is None
    with open(registry.warm_start("v1", "2026-03-02"), "rb") as fh:
        assert fh.read() == b"march 1"
    assert registry.baseline("v1", "2026-03-02").metrics == {"rmse": 0.5}
    assert registry.baseline("v1", "2026-03-05").metrics == {"rmse": 0.2}
    assert registry.baseline("v2", "2026-03-05") is None

    publish(registry, tmp_path, "2026-03-01", b"march 1, reprocessed", 0.45, clear_number=1)
    with open(registry.warm_start("v1", "2026-03-02"), "rb") as fh:
        assert fh.read() == b"march 1, reprocessed"
    assert registry.baseline("v1", "2026-03-02").metrics == {"rmse": 0.45}
