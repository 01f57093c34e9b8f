"""Checkpoint cadence: Young and Young-Daly formulas, the MTBF estimate, the policy's rules."""

import math

import pytest
from pydantic import ValidationError

from ckpt.config import CheckpointConfig
from ckpt.interval import IntervalInputs, MovingAverage, MtbfEstimate, young_daly_interval_s, young_interval_s
from orchestrator.controller.policies import CheckpointIntervalPolicy


def test_formulas():
    assert young_interval_s(2.0, 3600.0) == pytest.approx(120.0)  # sqrt(2 * 2 * 3600)
    # Daly: C + sqrt(2 (M + R) C + C^2); with R = 0 it exceeds Young by C and a C^2 term.
    assert young_daly_interval_s(2.0, 3600.0, 0.0) == pytest.approx(2.0 + math.sqrt(14400.0 + 4.0))
    assert young_daly_interval_s(2.0, 3600.0, 400.0) == pytest.approx(2.0 + math.sqrt(16000.0 + 4.0))
    assert young_interval_s(0.0, 3600.0) == 0.0


def test_mtbf_posterior_moves_with_failures_and_exposure():
    est = MtbfEstimate(prior_s=1000.0, started_at=0.0)
    assert est.mtbf_s(now=0.0) == 1000.0
    assert est.mtbf_s(now=500.0) == 1500.0  # a clean run lengthens it slowly
    est.on_failure()
    est.on_failure()
    assert est.mtbf_s(now=500.0) == pytest.approx(500.0)  # (1000 + 500) / 3
    with pytest.raises(ValueError, match="positive"):
        MtbfEstimate(prior_s=0.0)


def test_moving_average():
    avg = MovingAverage(alpha=0.5)
    assert avg.value is None
    assert avg.add(4.0) == 4.0
    assert avg.add(2.0) == 3.0


def test_inputs_need_a_cost_before_an_interval():
    inputs = IntervalInputs(MtbfEstimate(prior_s=3600.0, started_at=0.0))
    assert inputs.interval_s("young", now=0.0) is None
    inputs.on_save_cost(2.0)
    assert inputs.interval_s("young", now=0.0) == pytest.approx(120.0)
    inputs.on_restart(400.0)
    assert inputs.interval_s("young-daly", now=0.0) == pytest.approx(2.0 + math.sqrt(16004.0))
    inputs.on_failure()  # M halves, tau shrinks by sqrt(2)
    assert inputs.interval_s("young", now=0.0) == pytest.approx(120.0 / math.sqrt(2))
    assert inputs.snapshot(now=0.0) == {"cost_s": 2.0, "mtbf_s": 1800.0, "restart_s": 400.0, "failures": 1.0}
    with pytest.raises(ValueError, match="young-daly"):
        inputs.interval_s("daly")


def _policy(**cfg) -> CheckpointIntervalPolicy:
    return CheckpointIntervalPolicy(CheckpointConfig(url="memory://x", **cfg), probe_steps=7)


def test_policy_rules():
    assert _policy(every_steps=5).every([1.0]) == 5
    assert _policy(every_steps=5).interval_s() is None
    assert _policy(every_seconds=30.0).every([0.5]) == 60
    assert _policy(interval=30.0).every([0.5]) == 60
    young = _policy(mtbf_s=3600.0)
    assert young.every([0.5]) == 7  # probe until a save cost is measured
    young.on_save_cost(2.0)
    assert young.interval_s() == pytest.approx(120.0, rel=1e-3)
    assert young.every([0.5]) == 240
    daly = _policy(interval="young-daly", mtbf_s=3600.0)
    daly.on_save_cost(2.0)
    assert daly.interval_s() > young.interval_s()


def test_node_mtbf_prior_divides_by_nodes():
    policy = _policy(node_mtbf_hours=8.0)
    policy.on_nodes(4)
    assert policy.inputs.mtbf.prior_s == 8 * 3600 / 4
    unchanged = _policy(mtbf_s=100.0)
    unchanged.on_nodes(4)
    assert unchanged.inputs.mtbf.prior_s == 100.0


def test_one_cadence_only():
    with pytest.raises(ValidationError, match="every_steps=3 and every_seconds=10.0 are both set"):
        CheckpointConfig(url="memory://x", every_steps=3, every_seconds=10.0)
    with pytest.raises(ValidationError, match="young-daly"):
        CheckpointConfig(url="memory://x", interval="daly")
