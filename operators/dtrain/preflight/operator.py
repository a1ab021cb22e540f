"""PreflightOperator: check every node before training; one clear summary; fail fast."""

from __future__ import annotations

from typing import Any, Sequence

from airflow.sdk import BaseOperator

from dtrain.launch.airflow.placement_args import PLACEMENT_FIELDS, PlacementArgs


class PreflightOperator(PlacementArgs, BaseOperator):
    """Run the node checks of :mod:`dtrain.preflight.checks` on every node of the job.

    Args:
        nodes, procs_per_node, backend, backend_options, device, gpus_per_node: as for
            DistributedTrainingOperator (templated), so preflight checks exactly the nodes that train.
        manifest_path: the staged dataset's manifest on the shared filesystem (templated).
        manifest_sha256: the manifest's expected digest; default: computed here on the worker,
            so every node must see the same bytes.
        checkpoint_dir: where checkpoints will go; its filesystem needs ``min_free_gb`` free.
        expect_gpus: require GPUs covering procs_per_node (default: when the spec would use GPUs).

    Returns through XCom: ``ok``, per-node facts and ``nccl_env`` (the NCCL settings to hand
    the training task's ``env``).
    """

    template_fields: Sequence[str] = (*PLACEMENT_FIELDS, "manifest_path", "manifest_sha256", "checkpoint_dir",
                                      "min_free_gb")
    ui_color = "#fdf1c7"

    def __init__(self, *, nodes: int | str = 1, procs_per_node: int | str = 1, backend: str = "local",
                 backend_options: dict[str, dict[str, Any]] | str | None = None, device: str = "auto",
                 gpus_per_node: int | None = None, manifest_path: str | None = None,
                 manifest_sha256: str | None = None, checkpoint_dir: str | None = None,
                 min_free_gb: float | str = 1.0, expect_gpus: bool | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.init_placement(nodes=nodes, procs_per_node=procs_per_node, backend=backend,
                            backend_options=backend_options, device=device, gpus_per_node=gpus_per_node)
        self.manifest_path, self.manifest_sha256 = manifest_path, manifest_sha256
        self.checkpoint_dir, self.min_free_gb, self.expect_gpus = checkpoint_dir, min_free_gb, expect_gpus

    def execute(self, context) -> dict[str, Any]:
        from dtrain.preflight.checks import file_sha256
        from dtrain.preflight.runner import PreflightError, run_preflight

        placement = self.resolve_placement()
        expected = self.manifest_sha256
        if self.manifest_path and not expected:
            try:
                expected = file_sha256(self.manifest_path)
            except OSError as e:
                raise PreflightError(f"manifest_path={self.manifest_path!r} is not readable here: {e}") from e
        report = run_preflight(placement, manifest_path=self.manifest_path, manifest_sha256=expected,
                               checkpoint_dir=self.checkpoint_dir, min_free_gb=float(self.min_free_gb),
                               expect_gpus=self.expect_gpus)
        for line in report["summary"]:
            self.log.info("%s", line)
        if not report["ok"]:
            raise PreflightError("\n".join(report["summary"]))
        return report
