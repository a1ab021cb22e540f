"""The training operator's extra links (``operator_extra_links``; the plugin registers them too).

In Airflow 3 a link is computed on the worker right after the task succeeds (get_link)
and stored in XCom for the UI; the training operator keeps its last result on itself,
so the link needs no extra lookup. Locations are turned into URLs by templates the
deployment sets, because only it knows how its shared filesystem and TensorBoard are
served; the "Training" link needs no setting: it opens the task instance's Training tab
(dtrain.ui, at :func:`~dtrain.launch.airflow.ui_urls.training_tab_url`), which shows the metrics,
verdicts, logs and checkpoints the job wrote:

* ``DTRAIN_STORAGE_URL`` (or ``AIRFLOW__DTRAIN__STORAGE_URL``), e.g. ``https://files.example/{path}``:
  a "Checkpoints" link to the checkpoint directory; none when unset (a ``file://`` link is one no
  browser opens from a web page).
* ``DTRAIN_TENSORBOARD_URL`` (or ``AIRFLOW__DTRAIN__TENSORBOARD_URL``), e.g.
  ``http://tensorboard:6006/?regexInput={job_id}``; no TensorBoard link when unset.

The template macros (``macros.dtrain.*``) are the plugin's (dtrain.plugin), not the operator's.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

from dtrain.launch.airflow.ui_urls import training_tab_url


def _setting(name: str) -> str | None:
    return os.environ.get(f"DTRAIN_{name}") or os.environ.get(f"AIRFLOW__DTRAIN__{name}")


def storage_url(path: str) -> str:
    """The deployment's URL of a path on the shared filesystem ('' when it serves none)."""
    template = _setting("STORAGE_URL")
    return template.format(path=quote(path)) if template else ""


def _result(operator: Any) -> dict[str, Any]:
    return getattr(operator, "last_result", None) or {}


class CheckpointLink(BaseOperatorLink):
    name = "Checkpoints"

    def get_link(self, operator, *, ti_key) -> str:
        result = _result(operator)
        return storage_url(result["checkpoint_dir"]) if result.get("checkpoint_dir") else ""


class TrainingLink(BaseOperatorLink):
    """The task instance's Training tab in the Airflow UI (per-rank curves, verdicts, logs, checkpoints)."""

    name = "Training"

    def get_link(self, operator, *, ti_key) -> str:
        return training_tab_url(ti_key.dag_id, ti_key.run_id, ti_key.task_id, ti_key.map_index)


class TensorBoardLink(BaseOperatorLink):
    name = "TensorBoard"

    def get_link(self, operator, *, ti_key) -> str:
        template, result = _setting("TENSORBOARD_URL"), _result(operator)
        if not template or not result:
            return ""
        return template.format(job_id=quote(str(result.get("job_id", ""))), run_dir=quote(str(result.get("run_dir", ""))))


LINKS = [TrainingLink(), CheckpointLink(), TensorBoardLink()]
