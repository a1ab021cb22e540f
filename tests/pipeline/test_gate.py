"""The publish gate and the train_command placeholders: pure functions, tested by exact comparison."""

from __future__ import annotations

import pytest

from dtrain.errors import SpecError
from dtrain.pipeline.gate import Gate
from dtrain.pipeline.placeholders import PLACEHOLDERS, to_jinja
from dtrain.pipeline.report import approval_markdown


def test_minimize_against_the_published_model_by_at_least_min_improvement():
    gate = Gate(metric="rmse", goal="minimize", min_improvement=0.05)
    better = gate.decide({"rmse": 0.40, "mae": 0.3}, {"rmse": 0.50}, published_model="/m/2026-01-01/model.pt")
    assert better.publish
    assert better.summary == ("gate: publish: rmse 0.4 vs published 0.5: better by 0.1 (lower is better), "
                              "at least min_improvement 0.05")
    assert (better.value, better.baseline, better.baseline_model) == (0.40, 0.50, "/m/2026-01-01/model.pt")
    slightly = gate.decide({"rmse": 0.48}, {"rmse": 0.50})
    assert not slightly.publish
    assert slightly.summary == ("gate: do not publish: rmse 0.48 vs published 0.5: better by 0.02 (lower is better), "
                                "less than min_improvement 0.05")
    worse = gate.decide({"rmse": 0.9}, {"rmse": 0.5})
    assert not worse.publish and "worse by 0.4 (lower is better)" in worse.summary


def test_maximize_with_a_threshold_and_no_published_model():
    gate = Gate(metric="accuracy", goal="maximize", threshold=0.9, min_improvement=0.0)
    first = gate.decide({"accuracy": 0.93}, None)
    assert first.publish
    assert first.summary == "gate: publish: accuracy 0.93 >= threshold 0.9; no published model to compare with"
    low = gate.decide({"accuracy": 0.85}, None)
    assert not low.publish and low.summary.startswith("gate: do not publish: accuracy 0.85 < threshold 0.9")
    # both rules must hold: above the bar but worse than what is published
    assert not gate.decide({"accuracy": 0.95}, {"accuracy": 0.96}).publish
    assert gate.decide({"accuracy": 0.96}, {"accuracy": 0.96}).publish  # 0: no worse
    minimize = Gate(metric="loss", goal="minimize", threshold=0.5)
    assert minimize.decide({"loss": 0.5}, None).summary == "gate: publish: loss 0.5 <= threshold 0.5"
    assert minimize.decide({"loss": 0.51}, None).summary == "gate: do not publish: loss 0.51 > threshold 0.5"


def test_threshold_only_never_reads_the_published_model():
    gate = Gate(metric="accuracy", goal="maximize", threshold=0.9)
    decision = gate.decide({"accuracy": 0.91}, {"accuracy": 0.99})
    assert decision.publish and decision.baseline is None
    assert Gate(metric="m", goal="maximize").decide({"m": 1}).summary == "gate: publish: m 1, no bar set"


def test_the_decision_goes_to_xcom_as_primitives():
    decision = Gate(metric="rmse", goal="minimize", threshold=1.0).decide({"rmse": 0.5}, None)
    assert decision.as_dict() == {
        "publish": True, "metric": "rmse", "goal": "minimize", "value": 0.5, "threshold": 1.0, "baseline": None,
        "baseline_model": None, "min_improvement": None, "tolerance": None, "relative_tolerance": None,
        "reasons": ["rmse 0.5 <= threshold 1"],
        "summary": "gate: publish: rmse 0.5 <= threshold 1"}


@pytest.mark.parametrize("metrics, field, value", [
    ({"rmse": float("nan")}, "evaluate()['rmse']", float("nan")),
    ({"rmse": float("inf")}, "evaluate()['rmse']", float("inf")),
    ({"rmse": True}, "evaluate()['rmse']", True),
    ({"rmse": "0.3"}, "evaluate()['rmse']", "0.3"),
    ({"mae": 0.3}, "evaluate()['rmse']", None),
    ([0.3], "evaluate()", [0.3]),
])
def test_a_metric_that_is_not_a_finite_number_never_passes(metrics, field, value):
    with pytest.raises(SpecError) as info:
        Gate(metric="rmse", goal="minimize", threshold=1.0).decide(metrics)
    assert info.value.field == field
    assert info.value.value == value or value != value  # NaN != NaN


@pytest.mark.parametrize("kwargs, field", [
    ({"metric": "", "goal": "minimize"}, "metric"),
    ({"metric": "rmse", "goal": "lower"}, "goal"),
    ({"metric": "rmse", "goal": "minimize", "threshold": float("nan")}, "threshold"),
    ({"metric": "rmse", "goal": "minimize", "min_improvement": -0.1}, "min_improvement"),
    ({"metric": "rmse", "goal": "minimize", "min_improvement": "0.1"}, "min_improvement"),
    ({"metric": "rmse", "goal": "minimize", "tolerance": -0.01}, "tolerance"),
    ({"metric": "rmse", "goal": "minimize", "tolerance": float("inf")}, "tolerance"),
    ({"metric": "rmse", "goal": "minimize", "relative_tolerance": 1.0}, "relative_tolerance"),
    ({"metric": "rmse", "goal": "minimize", "relative_tolerance": -0.005}, "relative_tolerance"),
    ({"metric": "rmse", "goal": "minimize", "relative_tolerance": True}, "relative_tolerance"),
    ({"metric": "rmse", "goal": "minimize", "min_improvement": 0.1, "tolerance": 0.01}, "min_improvement"),
])
def test_a_gate_is_checked_when_it_is_built(kwargs, field):
    with pytest.raises(SpecError) as info:
        Gate(**kwargs)
    assert info.value.field == field


def test_a_relative_tolerance_accepts_evaluation_noise_and_refuses_a_regression():
    # the newcomer's numbers: a clean model at f1 0.9849 vs the published 0.988, "no worse than 0.5%"
    gate = Gate(metric="f1", goal="maximize", relative_tolerance=0.005)
    noisy = gate.decide({"f1": 0.9849}, {"f1": 0.988}, published_model="/m/2026-01-01/model.pt")
    assert noisy.publish and noisy.baseline == 0.988
    assert noisy.summary == ("gate: publish: f1 0.9849 vs published 0.988: worse by 0.0031 (higher is better), "
                             "within tolerance 0.00494 (0.5% of 0.988)")
    regression = gate.decide({"f1": 0.97}, {"f1": 0.988})
    assert not regression.publish
    assert regression.summary == ("gate: do not publish: f1 0.97 vs published 0.988: worse by 0.018 (higher is better), "
                                  "beyond tolerance 0.00494 (0.5% of 0.988)")
    assert gate.decide({"f1": 0.99}, {"f1": 0.988}).publish  # better always passes


def test_an_absolute_tolerance_and_the_larger_of_both():
    absolute = Gate(metric="rmse", goal="minimize", tolerance=0.02)
    assert absolute.decide({"rmse": 0.51}, {"rmse": 0.5}).summary == (
        "gate: publish: rmse 0.51 vs published 0.5: worse by 0.01 (lower is better), within tolerance 0.02")
    assert absolute.decide({"rmse": 0.53}, {"rmse": 0.5}).summary == (
        "gate: do not publish: rmse 0.53 vs published 0.5: worse by 0.03 (lower is better), beyond tolerance 0.02")
    both = Gate(metric="rmse", goal="minimize", threshold=1.0, tolerance=0.02, relative_tolerance=0.1)
    # 10% of 0.5 = 0.05 is the larger: 0.54 passes although it is 0.04 worse
    assert both.decide({"rmse": 0.54}, {"rmse": 0.5}).summary == (
        "gate: publish: rmse 0.54 <= threshold 1; rmse 0.54 vs published 0.5: worse by 0.04 (lower is better), "
        "within tolerance 0.05 (the larger of 0.02 and 10% of 0.5)")
    # the relative part follows the baseline's magnitude, also for a negative metric
    assert Gate(metric="score", goal="maximize", relative_tolerance=0.1).decide(
        {"score": -2.15}, {"score": -2.0}).publish
    # a tolerance alone consults the published model (min_improvement left None); the first run has none
    assert both.compares and absolute.decide({"rmse": 9}, None).summary == (
        "gate: publish: no published model to compare with")
    assert not Gate(metric="rmse", goal="minimize", threshold=1.0).compares


def test_the_approval_request_shows_the_tolerance():
    decision = Gate(metric="f1", goal="maximize", relative_tolerance=0.005).decide(
        {"f1": 0.9849}, {"f1": 0.988}).as_dict()
    assert (decision["tolerance"], decision["relative_tolerance"]) == (None, 0.005)
    text = approval_markdown({"metrics": {"f1": 0.9849}}, decision)
    assert "| relative_tolerance | 0.005 |" in text and "| tolerance |" not in text
    assert "within tolerance 0.00494 (0.5% of 0.988)" in text.splitlines()[0]


TEMPLATES = {"shards": "{{ S }}", "output": "/runs/{{ P }}/model.pt", "version": "{{ V }}"}


def test_placeholders_become_their_templates_and_nothing_else_changes():
    assert to_jinja("--data={shards}", "train_command[1]", TEMPLATES, ["epochs"]) == "--data={{ S }}"
    assert to_jinja("{output}", "f", TEMPLATES, []) == "/runs/{{ P }}/model.pt"
    assert to_jinja("{params.epochs}", "f", TEMPLATES, ["epochs"]) == "{{ dtrain_params(params)['epochs'] }}"
    # The launcher's per-rank placeholders are left for the rank wrapper to fill.
    assert to_jinja("--deepspeed_config={deepspeed_config}", "f", TEMPLATES, []) == "--deepspeed_config={deepspeed_config}"
    assert to_jinja("{local_rank}/{rank}", "f", TEMPLATES, []) == "{local_rank}/{rank}"
    for literal in ('{"lr": 0.1}', "{ shards }", "{}", "{{shards}}x", "a{b-c}", "{0}", "plain", ""):
        assert to_jinja(literal, "f", TEMPLATES, ["epochs"]) == literal.replace("{shards}", "{{ S }}")


@pytest.mark.parametrize("text, allowed", [
    ("{shard}", "placeholders {shards}, {output}, {version}, {params.NAME} or the launcher's per-rank ones; "
                "{shard} is not one"),
    ("--epochs={params.epoch}", "{params.NAME} with NAME a param of this pipeline (epochs); {params.epoch} is not"),
    ("{params.x.y}", "{params.NAME} with NAME a param of this pipeline (epochs); {params.x.y} is not"),
    ("{output.name}", "placeholders {shards}, {output}, {version}, {params.NAME} or the launcher's per-rank ones; "
                      "{output.name} is not one"),
])
def test_an_unknown_placeholder_fails_naming_the_field_and_the_known_ones(text, allowed):
    with pytest.raises(SpecError) as info:
        to_jinja(text, "train_command[4]", TEMPLATES, ["epochs"])
    assert (info.value.field, info.value.value) == ("train_command[4]", text)
    assert info.value.allowed == allowed


def test_every_placeholder_is_documented_in_the_readme():
    import os

    from tests.conftest import REPO

    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    for name, meaning in PLACEHOLDERS.items():
        assert f"`{{{name}}}`" in readme, name


def test_the_approval_request_shows_the_verdict_and_every_metric_escaped():
    decision = Gate(metric="rmse", goal="minimize", min_improvement=0.0).decide(
        {"rmse": 0.4}, {"rmse": 0.5}, published_model="/m/a/model.pt").as_dict()
    text = approval_markdown({"metrics": {"rmse": 0.4, "a|b": "<script>"}, "model_path": "/r/model.pt"}, decision)
    assert text.splitlines()[0] == ("**gate: publish: rmse 0.4 vs published 0.5: better by 0.1 (lower is better), "
                                    "at least min_improvement 0**")
    assert "| new model | 0.4 |" in text and "| published model | 0.5 |" in text
    assert "| a\\|b | &lt;script> |" in text and "<script>" not in text
    assert "published model compared with: `/m/a/model.pt`" in text
