"""The goodput model behind `undying chaos sweep`, and the sweep's pure parts: intervals, specs, measurements."""

from __future__ import annotations

import dataclasses
import math

import pytest

from monitor.report import CheckpointRecord, FailureRecord, GoodputSummary, RunReport
from orchestrator.cli.chaos import sweep
from orchestrator.cli.chaos.goodput_model import inputs_from_reports, log_grid, model_goodput, young_tau
from orchestrator.spec.job_spec import load_spec
from orchestrator.spec.problems import SpecError


def test_model_is_first_order_and_peaks_at_young():
    # 1 - C/tau - (tau/2 + R)/M, by hand: C=2, M=100, R=5, tau=20 -> 1 - 0.1 - 0.15.
    assert model_goodput(20.0, 2.0, 100.0, 5.0) == pytest.approx(0.75)
    assert young_tau(2.0, 100.0) == pytest.approx(20.0)
    grid = log_grid(1.0, 200.0, 4000)
    best = max(grid, key=lambda t: model_goodput(t, 2.0, 100.0, 5.0))
    assert best == pytest.approx(20.0, rel=2e-3)  # the maximum of the model is Young's interval
    assert model_goodput(20.0, 2.0, 100.0, 0.0) - model_goodput(20.0, 2.0, 100.0, 5.0) == pytest.approx(0.05)
    assert model_goodput(0.01, 2.0, 100.0) == 0.0 and model_goodput(1000.0, 2.0, 100.0) == 0.0  # clamped
    with pytest.raises(ValueError):
        model_goodput(0.0, 1.0, 10.0)
    assert grid[0] == pytest.approx(1.0) and grid[-1] == pytest.approx(200.0)


def _report(saves=(0.2, 0.4, 0.3), failures=((0.05, 2.0), (0.1, 4.0)), commits=(10, 20, 30, 45, 55),
            failed_at=(38.0,), productive=60.0, startup=20.0, lost=20.0) -> RunReport:
    return RunReport(
        job="j", final_step=100, status="succeeded",
        checkpoints=[CheckpointRecord(step=i, committed_at=t, bytes=1, blocking_s=saves[i % len(saves)], total_s=1.0)
                     for i, t in enumerate(commits)],
        failures=[FailureRecord(time=failed_at[i % len(failed_at)], kind="kill_rank", rank=0, detected_after_s=d,
                                recovered_after_s=r) for i, (d, r) in enumerate(failures)],
        goodput=GoodputSummary.from_totals({"productive": productive, "startup": startup, "lost_work": lost}))


def test_inputs_are_medians_of_what_the_runs_measured():
    a = _report(saves=(0.2, 0.4, 0.3), failures=((0.05, 2.0),))
    b = _report(saves=(0.5,), failures=((0.1, 4.0), (0.1, 6.0)))
    inputs = inputs_from_reports([a.model_dump(mode="json"), b.model_dump(mode="json")], mtbf_s=50.0)
    assert inputs.saves == 10 and inputs.restarts == 3
    assert inputs.cost_s == pytest.approx(0.45)  # median of 0.2,0.4,0.3,0.2,0.4 and five 0.5
    assert inputs.restart_s == pytest.approx(4.1)
    assert inputs.tau_star == pytest.approx(math.sqrt(2 * 0.45 * 50.0))
    with pytest.raises(ValueError, match="save cost"):
        inputs_from_reports([_report(commits=()).model_dump(mode="json")], mtbf_s=50.0)


def test_intervals_parse_or_name_the_bad_one():
    got = sweep.parse_intervals("5s, 10s,1m,young,young-daly")
    assert [(i.label, i.seconds) for i in got] == [("5s", 5.0), ("10s", 10.0), ("1m", 60.0), ("young", None),
                                                   ("young-daly", None)]
    for bad in ("5s,soon", "", "0s", "-3s"):
        with pytest.raises(SpecError) as err:
            sweep.parse_intervals(bad)
        assert err.value.problems[0].field == "--intervals"


def _spec(*sets: str):
    return load_spec("examples/demo.yaml", ["chaos.faults=[]", "checkpoint.url=file:///tmp/undying-unit",
                                            "chaos.mtbf_s=60s", "chaos.mtbf_kind=kill_rank", "chaos.seed=7", *sets])


def test_each_interval_gets_its_own_run_under_the_same_failures():
    base = _spec()
    assert sweep.system_mtbf_s(base) == pytest.approx(15.0)  # 60 s per rank, 4 ranks
    fixed = sweep.sweep_spec(base, sweep.Interval("10s", 10.0), step_s=0.4)
    young = sweep.sweep_spec(base, sweep.Interval("young", None), step_s=0.4)
    assert fixed.checkpoint.every_steps == 25 and fixed.checkpoint.rule == "steps"
    assert young.checkpoint.every_steps is None and young.checkpoint.rule == "young"
    assert young.checkpoint.mtbf_s == pytest.approx(15.0)  # the rule is told the experiment's system MTBF
    assert fixed.name != young.name and fixed.checkpoint_root != young.checkpoint_root != base.checkpoint_root
    assert fixed.chaos == young.chaos == base.chaos  # same seeded failure process
    assert fixed.elastic.max_restarts >= 1000
    calibrate = sweep.calibration_spec(base)
    assert calibrate.chaos.mtbf_s is None and calibrate.train.steps == 30
    long_warmup = sweep.calibration_spec(_spec("train.steps=200", "train.warmup_steps=100"))
    assert (long_warmup.train.steps, long_warmup.train.warmup_steps) == (30, 30)  # cut to the short run
    with pytest.raises(SpecError):
        sweep.system_mtbf_s(_spec("chaos.mtbf_kind=kill_node"))


def test_measure_reads_goodput_interval_cost_and_restart():
    row = sweep.measure("10s", 10.0, 25, _report())
    assert row.goodput == pytest.approx(0.6) and row.steady_goodput == pytest.approx(0.75)  # 60 / (100 - 20)
    assert row.realised_s == pytest.approx(10.0)  # gaps 10, 10, (15 spans the failure at 38), 10
    assert row.cost_s == pytest.approx(0.3) and row.restart_s == pytest.approx(3.075)
    assert row.failures == 2 and row.checkpoints == 5
    young = sweep.measure("young", None, None, _report(productive=55.0, lost=25.0))
    inputs = inputs_from_reports([_report().model_dump(mode="json")], mtbf_s=15.0)
    result = sweep.summary([row, young], inputs)
    assert result["best_fixed"]["label"] == "10s"
    assert result["young"]["points_below_best"] == pytest.approx(100 * (0.75 - 55 / 80))
    assert sweep.against_best(4.66) == "4.7 points below" and sweep.against_best(-5.5) == "5.5 points above"
    crashed = dataclasses.replace(young, status="failed")  # its goodput is of the part it ran: no verdict
    assert "young" not in sweep.summary([row, crashed], inputs)
    text = sweep.table([row, young], inputs)
    assert "| 10s | storage | 25 steps | 10.0 s | 60.0% | 75.0% |" in text
    assert "| young | storage | adaptive steps |" in text


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from orchestrator.cli.chaos.sweep_plot import plot_sweep

    rows = [sweep.measure("5s", 5.0, 12, _report(commits=(5, 10, 15))), sweep.measure("young", None, None, _report()),
            sweep.measure("5s", 5.0, 12, _report(commits=(5, 10, 15), productive=70.0), "two-level"),
            sweep.measure("young", None, None, _report(productive=70.0), "two-level")]
    path = tmp_path / "sweep.png"
    plot_sweep(rows, inputs_from_reports([_report().model_dump(mode="json")], mtbf_s=15.0), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_levels_run_each_interval_with_and_without_the_memory_level():
    base = _spec()
    assert sweep.parse_levels(None, base) == ["two-level"]  # the memory level is on by default
    assert sweep.parse_levels(None, _spec("checkpoint.memory.enabled=false")) == ["storage"]
    assert sweep.parse_levels("storage, two-level", base) == ["storage", "two-level"]
    for bad in ("memory", "storage,storage", ""):
        with pytest.raises(SpecError) as err:
            sweep.parse_levels(bad, base)
        assert err.value.problems[0].field == "--levels"
    storage = sweep.sweep_spec(base, sweep.Interval("young", None), step_s=0.4, level="storage")
    both = sweep.sweep_spec(base, sweep.Interval("young", None), step_s=0.4, level="two-level")
    assert not storage.checkpoint.memory.enabled and both.checkpoint.memory.enabled
    assert storage.checkpoint.rule == both.checkpoint.rule == "young" and storage.chaos == both.chaos
    assert storage.checkpoint_root != both.checkpoint_root


def test_two_level_gain_is_per_interval_and_kept_out_of_the_storage_model():
    def failure(level):
        return FailureRecord(time=38.0, kind="kill_rank", rank=0, detected_after_s=0.1, recovered_after_s=1.0,
                             restore_level=level)

    slow = _report(productive=60.0, lost=20.0)
    fast = _report(productive=75.0, lost=5.0).model_copy(update={"failures": [failure("memory"), failure("storage")]})
    rows = [sweep.measure("5s", 5.0, 12, slow), sweep.measure("5s", 5.0, 12, fast, "two-level")]
    assert rows[1].memory_recoveries == 1 and rows[0].memory_recoveries == 0
    inputs = inputs_from_reports([slow.model_dump(mode="json")], mtbf_s=15.0)
    result = sweep.summary(rows, inputs)
    gain = result["two_level_vs_storage"]["5s"]
    assert gain["goodput_points"] == pytest.approx(15.0)  # 75% against 60%
    assert gain["wall_change"] == pytest.approx(rows[1].wall_s / rows[0].wall_s - 1)
    assert result["best_fixed"]["steady_goodput"] == pytest.approx(0.75)  # the storage row, not the two-level one
    assert "| 5s | two-level (1 from memory) | 12 steps |" in sweep.table(rows, inputs)
