"""Throughput planner figures (pure functions)."""

from __future__ import annotations

import pytest

from dtrain.errors import SpecError
from dtrain.staging.errors import ThroughputError
from dtrain.staging.planner import plan, round_capacity, verdict


def test_guide_example_100gb_in_30s_needs_about_3_3_gbps():
    p = plan("100GB", 30, nodes=4, deployment_type="SCRATCH_2")
    assert p.required_mbps == pytest.approx(3333.3, abs=0.1)
    assert p.per_node_mbps == pytest.approx(833.3, abs=0.1)
    [option] = p.options
    assert option.capacity_tib == pytest.approx(16.8)            # 1.2, 2.4, then +2.4 TiB steps
    assert option.throughput_mbps == pytest.approx(3360)
    assert "gives 240 MB/s" in p.smallest[0]                      # the guide's 1.2 TiB SCRATCH_2


def test_capacity_rounds_to_the_types_increments_and_holds_the_data():
    assert round_capacity(0.1, {"first": [1.2, 2.4], "increment": 2.4}) == 1.2
    assert round_capacity(2.41, {"first": [1.2, 2.4], "increment": 2.4}) == pytest.approx(4.8)
    assert round_capacity(2.41, {"first": [1.2, 2.4], "increment": 3.6}) == pytest.approx(6.0)
    # A slow epoch target still needs room for the data: 50 TiB of data at 1 MB/s.
    p = plan("50TiB", 10**9, deployment_type="PERSISTENT_2")
    assert all(o.capacity_tib >= 50 for o in p.options)
    assert [o.mbps_per_tib for o in p.options] == [125, 250, 500, 1000]


def test_table_is_data_the_user_overrides():
    table = {"TINY": {"throughput_mbps_per_tib": [100], "capacity_tib": {"first": [1], "increment": 1}}}
    p = plan(10**9 * 100, 100, table=table)
    assert [(o.deployment_type, o.capacity_tib) for o in p.options] == [("TINY", 10)]
    with pytest.raises(SpecError, match="table"):
        plan("1GB", 1, table={"BAD": {"throughput_mbps_per_tib": []}})


def test_bad_inputs_name_the_field():
    with pytest.raises(SpecError, match="epoch_seconds"):
        plan("1GB", 0)
    with pytest.raises(SpecError, match="nodes"):
        plan("1GB", 10, nodes=0)
    with pytest.raises(SpecError, match="dataset_size"):
        plan("-5GB", 10)


def test_verdict_warns_or_fails_when_staging_is_slower_than_training_reads():
    p = plan("100GB", 30, nodes=4, deployment_type="SCRATCH_2")
    slow = verdict(p, 240.0)
    assert slow["ok"] is False and "below" in slow["message"] and "16.8 TiB" in slow["message"]
    assert verdict(p, 4000.0)["ok"] is True
    assert verdict(p, 0.0)["ok"] is None
    with pytest.raises(ThroughputError, match="below"):
        verdict(p, 240.0, fail=True)
