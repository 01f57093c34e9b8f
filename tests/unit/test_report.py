"""RunReport: JSON round-trip, terminal table, progress line and the PNG timeline."""

from __future__ import annotations

import json
import math

import pytest

from monitor.goodput import BUCKETS, GoodputLedger
from monitor.report import (
    CheckpointRecord,
    FailureRecord,
    GoodputSummary,
    LossPoint,
    RunReport,
    WorldRecord,
    progress_line,
)
from monitor.timeline import plot_timeline

REQUIRED_KEYS = {
    "job",
    "final_step",
    "final_loss",
    "losses",
    "world_history",
    "failures",
    "checkpoints",
    "goodput",
    "status",
    "error",
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_report(final_loss: float = 3.5) -> RunReport:
    """A 60-step run: one rank killed at step 33, shrunk from dp4 to dp3, resumed from step 30."""
    clock = FakeClock()
    ledger = GoodputLedger(clock=clock)  # t=0: startup
    for at, bucket in [(4.0, "productive"), (34.0, "detection"), (34.5, "reformation")]:
        clock.now = at
        ledger.enter(bucket)
    clock.now = 36.0
    ledger.enter("checkpoint_restore")
    clock.now = 39.0
    ledger.enter("productive")
    clock.now = 40.0
    ledger.move(1.5, "productive", "checkpoint_save")  # blocking saves, learned from receipts
    ledger.move(3.0, "productive", "lost_work")  # steps 31..33 rolled back
    ledger.stop()
    losses = [LossPoint(step=s, loss=6.0 - s / 20, time=10.0 + s * 0.5, tokens_per_s=1000.0 + s) for s in range(1, 61)]
    return RunReport(
        job="demo",
        final_step=60,
        final_loss=final_loss,
        losses=losses,
        world_history=[
            WorldRecord(generation=1, world_size=8, dp=4, tp=2, pp=1, started_at=0.0),
            WorldRecord(generation=2, world_size=6, dp=3, tp=2, pp=1, started_at=34.5),
        ],
        failures=[
            FailureRecord(
                time=34.0,
                kind="actor_died",
                rank=5,
                detected_after_s=0.03,
                recovered_after_s=5.0,
                message="rank 5 died (node n2)",
                step=33,
            )
        ],
        checkpoints=[
            CheckpointRecord(step=s, committed_at=4.0 + s, bytes=1 << 20, blocking_s=0.5, total_s=2.0)
            for s in (10, 20, 30)
        ],
        goodput=GoodputSummary.from_ledger(ledger),
        status="succeeded",
        tokens_per_s=12_345.0,
    )


def test_goodput_summary_matches_the_ledger():
    summary = make_report().goodput
    assert summary.wall_s == 40.0
    assert summary.productive_s == 30.0 - 1.5 - 3.0 + 1.0
    assert summary.badput_s["startup"] == 4.0
    assert summary.badput_s["lost_work"] == 3.0
    assert summary.productive_s + sum(summary.badput_s.values()) == summary.clock_wall_s  # the ledger's clock
    assert summary.ratio == summary.productive_s / 40.0
    assert GoodputSummary.from_totals({}).ratio == 0.0


def test_json_round_trip_has_every_required_key(tmp_path):
    report = make_report()
    path = tmp_path / "runs" / "demo" / "report.json"  # parent directories do not exist yet
    report.to_json(path)
    raw = json.loads(path.read_text())
    assert set(raw) >= REQUIRED_KEYS
    assert set(raw["losses"][0]) == {"step", "loss", "time", "tokens_per_s"}
    assert set(raw["world_history"][0]) == {"generation", "world_size", "dp", "tp", "pp", "started_at"}
    assert {"time", "kind", "rank", "detected_after_s", "recovered_after_s", "message"} <= set(
        raw["failures"][0]
    )
    assert set(raw["checkpoints"][0]) == {"step", "committed_at", "bytes", "blocking_s", "total_s"}
    assert set(raw["goodput"]) == {"ratio", "wall_s", "productive_s", "badput_s", "clock_wall_s"}
    assert set(raw["goodput"]["badput_s"]) == set(BUCKETS) - {"productive"}
    assert RunReport.from_json(path) == report
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]  # no temporary file left


def test_nan_loss_survives_as_valid_json(tmp_path):
    path = tmp_path / "report.json"
    make_report(final_loss=math.nan).to_json(path)
    assert json.loads(path.read_text())["final_loss"] == "NaN"  # strict JSON, not a bare NaN token
    assert math.isnan(RunReport.from_json(path).final_loss)


def test_status_is_checked():
    with pytest.raises(ValueError, match="status"):
        RunReport(job="x", final_step=0, goodput=GoodputSummary.from_totals({}), status="done")


def test_summary_table_mentions_every_bucket_and_the_run_facts():
    table = make_report().summary_table()
    for bucket in BUCKETS:
        assert bucket in table
    lines = table.splitlines()
    assert any(line.split() == ["steps", "60"] for line in lines)
    assert any(line.split() == ["final", "loss", "3.500"] for line in lines)
    assert any(line.split() == ["tokens/s", "12.3k"] for line in lines)
    assert any(line.split() == ["failures", "1"] for line in lines)
    assert any(line.split() == ["recoveries", "1"] for line in lines)
    assert any(line.split() == ["checkpoints", "3"] for line in lines)
    assert any(line.split() == ["lost_work", "3.0", "7.5%"] for line in lines)
    assert any(line.split() == ["wall", "40.0", "100.0%"] for line in lines)


def test_progress_line():
    assert (
        progress_line(25, 60, 4.1234, 12_345.0, 0.8712) == "[  25/60] loss 4.123  tok/s 12.3k  goodput 87.1%"
    )
    assert progress_line(7, 12_000, None, None, 0.0) == "[    7/12000] loss -  tok/s -  goodput 0.0%"
    assert "tok/s 1.0M" in progress_line(1, 2, 1.0, 999_960.0, 1.0)
    assert "tok/s 950" in progress_line(1, 2, 1.0, 950.0, 1.0)
    assert "loss nan" in progress_line(1, 2, math.nan, 1.0, 1.0)


def test_timeline_png_is_written(tmp_path):
    path = tmp_path / "plots" / "timeline.png"
    plot_timeline(make_report(), path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000  # three panels of curves and bars, not an empty canvas


def test_timeline_of_an_empty_failed_run(tmp_path):
    report = RunReport(
        job="x", final_step=0, goodput=GoodputSummary.from_totals({}), status="failed", error="bad spec"
    )
    path = tmp_path / "timeline.png"
    plot_timeline(report, path)
    assert path.stat().st_size > 0
    assert "failed (bad spec)" in report.summary_table()


def test_a_long_run_s_loss_curve_is_thinned_to_a_bounded_size_keeping_its_ends():
    from monitor.report import LOSS_POINTS, loss_curve_steps

    short = list(range(LOSS_POINTS))
    assert loss_curve_steps(short) == short
    long = list(range(5, 5 + 2 * LOSS_POINTS + 3))  # a resumed run: its first step is 5
    kept = loss_curve_steps(long)
    assert kept[0] == 5 and kept[-1] == long[-1] and len(kept) <= LOSS_POINTS + 1
    assert len({b - a for a, b in zip(kept[:-2], kept[1:-1], strict=True)}) == 1  # one stride, the last aside
