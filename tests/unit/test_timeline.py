"""The timeline figure marks every failure three ways (fault, detection, training again), read
back from the figure's artists before anything is saved."""

from __future__ import annotations

import pytest

from monitor.report import FailureRecord, FaultRecord, GoodputSummary, LossPoint, RunReport, WorldRecord
from monitor.timeline import plot_timeline, timeline_figure


def chaos_report() -> RunReport:
    """Two injected rank kills that recovered and a third failure whose cause has no known time
    and that never recovered (the job failed)."""
    failures = [
        FailureRecord(time=12.05, kind="kill_rank", rank=1, detected_after_s=0.05, recovered_after_s=1.5, step=20),
        FailureRecord(time=30.2, kind="kill_rank", rank=3, detected_after_s=0.2, recovered_after_s=2.0, step=50),
        FailureRecord(time=41.0, kind="actor_died", rank=2, message="rank 2 died", step=61),
    ]
    return RunReport(job="demo", final_step=61, status="failed", failures=failures,
                     losses=[LossPoint(step=s, loss=5 - s / 30, time=s * 0.6, tokens_per_s=900.0) for s in range(62)],
                     world_history=[WorldRecord(generation=0, world_size=4, dp=4, tp=1, pp=1, started_at=0.0)],
                     goodput=GoodputSummary.from_totals({"productive": 36.0, "detection": 0.3, "lost_work": 4.7}))


def with_faults(report: RunReport) -> RunReport:
    """The report as a chaos run records it: every fault that fired, two of them in one step (one
    failure), and a storage fault (no failure at all)."""
    faults = [FaultRecord(time=12.0, kind="kill_rank", rank=1, step=20), FaultRecord(time=12.03, kind="kill_rank",
              rank=2, step=20), FaultRecord(time=22.0, kind="storage_error"), FaultRecord(time=30.0, kind="kill_rank",
              rank=3, step=50), FaultRecord(time=None, kind="corrupt_shard", step=40)]
    return report.model_copy(update={"faults": faults})


def _marks(fig, gid: str) -> list[float]:
    """x positions (job seconds) of the events panel's artists with this gid."""
    (events,) = [ax for ax in fig.axes if ax.get_title() == "events and throughput"]
    return [float(line.get_xdata()[0]) for line in events.lines if line.get_gid() == gid]


def test_every_fault_detection_and_recovery_is_marked_where_it_happened():
    fig = timeline_figure(chaos_report(), title="random kill_rank with MTBF 20 s")
    assert _marks(fig, "fault") == pytest.approx([12.0, 30.0])  # the third has no known fault time
    assert _marks(fig, "detection") == pytest.approx([12.05, 30.2, 41.0])
    assert _marks(fig, "recovery") == pytest.approx([13.55, 32.2])  # the third never trained again
    (events,) = [ax for ax in fig.axes if ax.get_title() == "events and throughput"]
    assert {t.get_text() for t in events.texts} == {"kill_rank r1", "kill_rank r3"}
    legend = [t.get_text() for t in events.get_legend().get_texts()]
    assert legend == ["fault", "detected", "training again"]  # one entry each, however many failures
    assert fig.get_suptitle().startswith("random kill_rank with MTBF 20 s\ndemo: failed")


def test_every_recorded_fault_is_marked_even_one_that_made_no_failure(tmp_path):
    report = with_faults(chaos_report())
    fig = timeline_figure(report)
    assert _marks(fig, "fault") == pytest.approx([12.0, 12.03, 22.0, 30.0])  # the one without a time: not drawn
    assert _marks(fig, "detection") == pytest.approx([12.05, 30.2, 41.0])
    (events,) = [ax for ax in fig.axes if ax.get_title() == "events and throughput"]
    labels = {t.get_text(): t.xyann for t in events.texts}
    assert set(labels) == {"kill_rank r1", "kill_rank r2", "storage_error", "kill_rank r3"}
    assert labels["kill_rank r2"][1] < labels["kill_rank r1"][1]  # a moment apart: one under the other
    assert type(report).from_json(_saved(report, tmp_path)).faults == report.faults  # the report keeps them


def _saved(report: RunReport, tmp_path) -> str:
    path = tmp_path / "report.json"
    report.to_json(path)
    return str(path)


def test_a_run_without_failures_has_no_failure_marks(tmp_path):
    report = chaos_report().model_copy(update={"failures": [], "status": "succeeded"})
    fig = timeline_figure(report)
    assert [_marks(fig, gid) for gid in ("fault", "detection", "recovery")] == [[], [], []]
    plot_timeline(report, tmp_path / "t.png")  # the old call, without a title, still writes the PNG
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


def test_the_controller_records_each_fired_fault_on_the_job_clock_and_the_event_log_keeps_them():
    from monitor.events import end_event, report_from_events
    from monitor.goodput import GoodputLedger
    from monitor.metrics import JobMetrics
    from orchestrator.controller.job_record import JobRecord
    from orchestrator.wire.messages import FaultFired

    record = JobRecord("unit", 4, JobMetrics("unit"), GoodputLedger(), printer=lambda _: None)
    record.on_fault(FaultFired(0, "kill_rank", time=record.started + 2.5, rank=1, step=3, point="after_backward"))
    report = record.report("succeeded", 4)
    (fault,) = report.faults
    assert (fault.time, fault.kind, fault.rank, fault.step, fault.point) == (
        pytest.approx(2.5), "kill_rank", 1, 3, "after_backward")
    assert report_from_events([end_event(report)]).faults == report.faults  # `undying report` draws them too
