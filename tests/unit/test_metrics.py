"""JobMetrics: a real exporter on loopback, scraped over HTTP as Prometheus would."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from monitor.goodput import BADPUT_CAUSES, GoodputLedger
from monitor.metrics import JobMetrics
from monitor.straggler import StragglerDetector

HOST = "127.0.0.1"
JOB = "demo"
# No proxy, whatever the environment says: the tests speak to loopback only.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

GAUGES = [
    "undying_step",
    "undying_mfu_ratio",
    "undying_loss",
    "undying_grad_norm",
    "undying_loss_scale",
    "undying_goodput_ratio",
    "undying_checkpoint_bytes",
    "undying_checkpoint_last_committed_step",
    "undying_checkpoint_interval_seconds",
    "undying_checkpoint_cost_seconds",
    "undying_mtbf_seconds",
    "undying_restart_seconds",
    "undying_generation",
    "undying_world_size",
]
HISTOGRAMS = [
    "undying_step_seconds",
    "undying_checkpoint_blocking_seconds",
    "undying_checkpoint_commit_latency_seconds",
    "undying_detection_seconds",
    "undying_recovery_seconds",
]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def metrics():
    m = JobMetrics(JOB)
    yield m
    m.close()


def scrape(port: int) -> str:
    with _OPENER.open(f"http://{HOST}:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of an exposition text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, frozenset({"undying_job": JOB, **labels}.items()))]


def feed(metrics: JobMetrics) -> GoodputLedger:
    """One of each controller event, with known numbers."""
    metrics.on_step(25, step_s=0.5, tokens=4096, loss=4.25, grad_norm=1.5, mfu=0.4, loss_scale=1024.0)
    metrics.on_checkpoint(20, nbytes=1_000_000, blocking_s=0.2, total_s=1.5, interval_s=30.0)
    metrics.on_interval_inputs({"cost_s": 0.2, "mtbf_s": 3600.0, "restart_s": 3.0})
    metrics.on_checkpoint_skipped()
    metrics.on_failure("actor_died")
    metrics.on_failure("actor_died")
    metrics.on_failure("hang")
    metrics.on_recovery(detection_s=0.1, recovery_s=12.0)
    metrics.on_layout(generation=2, world_size=8, dp=2, tp=2, pp=2)
    metrics.on_state("RUNNING")
    for rank, seconds in enumerate([1.0, 1.0, 1.1, 3.0]):
        metrics.on_rank_compute(rank, seconds)
    metrics.on_stragglers({3}, {3: 1.4})
    metrics.on_bubble(0.25)
    metrics.on_memory("predicted", {"state": 100, "activation": 50, "collective": 10, "transient": 5})
    clock = FakeClock()
    ledger = GoodputLedger(clock=clock)
    clock.now = 2.0
    ledger.enter("productive")
    clock.now = 10.0
    ledger.move(1.0, "productive", "checkpoint_save")
    metrics.on_goodput(ledger)
    return ledger


def feed_every_event(metrics: JobMetrics) -> None:
    """`feed`, and every other `on_*` event, so that every family has samples."""
    feed(metrics)
    metrics.on_eval(25, 4.5)
    metrics.on_recovery_level("memory", restore_s=0.5, lost_s=2.0)
    metrics.on_memory_snapshot(25, {0: 1000, 1: 1000})
    metrics.on_control_rejected("events")
    metrics.on_spares(ready=1, warming=1)
    metrics.on_spares_started(2)
    metrics.on_checkpoint_failed()
    metrics.on_memory("measured", {"state": 90, "activation": 40, "collective": 10, "transient": 5})


def test_names_and_labels_follow_prometheus_conventions(metrics):
    # Counters end in _total and nothing else does; every series names its job in `undying_job`, never
    # in `job`, which Prometheus owns (the scrape job's name).
    feed_every_event(metrics)
    families = list(metrics.registry.collect())
    for family in families:
        for sample in family.samples:
            assert "job" not in sample.labels and sample.labels["undying_job"] == JOB, sample
        if family.type == "counter":
            assert {smp.name for smp in family.samples} <= {f"{family.name}_total", f"{family.name}_created"}
        else:
            assert not family.name.endswith("_total"), family.name
    types = {family.name: family.type for family in families}
    assert types["undying_badput_seconds"] == types["undying_tokens"] == "counter"
    assert types["undying_productive_seconds"] == "gauge"  # a rollback shrinks it
    assert types["undying_checkpoint_commit_latency_seconds"] == "histogram"


def test_every_name_and_label_is_exposed_with_its_value(metrics):
    port = metrics.serve(HOST, 0)
    assert port > 0 and metrics.port == port
    feed(metrics)
    text = scrape(port)
    for name in GAUGES:
        assert (name, frozenset({("undying_job", JOB)})) in samples(text), name
    for name in HISTOGRAMS:
        assert value(text, f"{name}_count") == 1, name
    assert value(text, "undying_step") == 26  # steps done: index 25 is the 26th
    assert value(text, "undying_tokens_total") == 4096
    assert value(text, "undying_loss") == 4.25
    assert value(text, "undying_loss_scale") == 1024
    assert value(text, "undying_checkpoint_last_committed_step") == 20
    assert value(text, "undying_checkpoint_skipped_total") == 1
    assert value(text, "undying_checkpoint_failures_total") == 0
    assert value(text, "undying_failures_total", kind="actor_died") == 2
    assert value(text, "undying_failures_total", kind="hang") == 1
    assert value(text, "undying_recovery_seconds_sum") == 12.0
    assert [value(text, "undying_parallel_degree", dim=d) for d in ("dp", "tp", "pp")] == [2, 2, 2]
    assert value(text, "undying_controller_state", state="RUNNING") == 1
    assert value(text, "undying_rank_step_compute_seconds", rank="3") == 3.0
    assert [value(text, "undying_straggler", rank=str(r)) for r in range(4)] == [0, 0, 0, 1]
    assert value(text, "undying_straggler_ratio", rank="3") == 1.4  # the detector's ratio to its peers
    assert value(text, "undying_pipeline_bubble_ratio") == 0.25
    assert value(text, "undying_memory_bytes", ledger="activation", kind="predicted") == 50


def test_goodput_totals_are_exposed_per_cause(metrics):
    port = metrics.serve(HOST, 0)
    feed(metrics)
    text = scrape(port)
    assert f'undying_badput_seconds_total{{cause="startup",undying_job="{JOB}"}} 2.0' in text
    for cause in BADPUT_CAUSES:
        assert (("undying_badput_seconds_total", frozenset({"undying_job": JOB, "cause": cause}.items()))) in samples(
            text
        )
    assert value(text, "undying_badput_seconds_total", cause="checkpoint_save") == 1.0
    assert value(text, "undying_productive_seconds") == 7.0
    assert value(text, "undying_goodput_ratio") == 0.7


def test_values_update_between_scrapes(metrics):
    port = metrics.serve(HOST, 0)
    ledger = feed(metrics)
    metrics.on_step(26, step_s=0.25, tokens=4096, loss=4.0, grad_norm=None)
    metrics.on_checkpoint(30, nbytes=2_000_000, blocking_s=0.3, total_s=1.0, interval_s=None)
    metrics.on_state("RECOVERING")
    metrics.on_layout(generation=3, world_size=2, dp=2, tp=1, pp=1)
    metrics.on_rank_compute(0, 0.5)
    ledger.move(7.0, "productive", "lost_work")  # a rollback shrinks productive: a gauge may do that
    metrics.on_goodput(ledger)
    text = scrape(port)
    assert value(text, "undying_step") == 27
    assert value(text, "undying_tokens_total") == 8192
    # Not reported this time: the last value is kept.
    assert value(text, "undying_mfu_ratio") == 0.4
    assert value(text, "undying_grad_norm") == 1.5
    assert value(text, "undying_checkpoint_interval_seconds") == 30.0
    metrics.on_interval_inputs({"cost_s": 0.25, "mtbf_s": 1800.0, "restart_s": None})
    text = scrape(port)
    assert value(text, "undying_checkpoint_cost_seconds") == 0.25
    assert value(text, "undying_mtbf_seconds") == 1800.0
    assert value(text, "undying_checkpoint_last_committed_step") == 30
    assert value(text, "undying_checkpoint_blocking_seconds_count") == 2
    assert value(text, "undying_step_seconds_count") == 2
    assert value(text, "undying_controller_state", state="RUNNING") == 0
    assert value(text, "undying_controller_state", state="RECOVERING") == 1
    assert value(text, "undying_generation") == 3
    assert value(text, "undying_parallel_degree", dim="tp") == 1
    # Ranks of the old, larger world are gone rather than frozen at their last value.
    assert ("undying_rank_step_compute_seconds", frozenset({"undying_job": JOB, "rank": "3"}.items())) not in samples(
        text
    )
    assert value(text, "undying_rank_step_compute_seconds", rank="0") == 0.5
    assert value(text, "undying_productive_seconds") == 0.0
    assert value(text, "undying_badput_seconds_total", cause="lost_work") == 7.0


def test_close_frees_the_port(metrics):
    port = metrics.serve(HOST, 0)
    scrape(port)
    metrics.close()
    assert metrics.port is None
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
    assert metrics.serve(HOST, port) == port  # the same job can serve again on the freed port
    assert "undying_step" in scrape(port)


def test_serving_twice_is_refused(metrics):
    port = metrics.serve(HOST, 0)
    with pytest.raises(RuntimeError, match=str(port)):
        metrics.serve(HOST, 0)


def test_two_jobs_in_one_process_do_not_collide():
    first, second = JobMetrics("a"), JobMetrics("b")
    first.on_failure("hang")
    assert first.registry is not second.registry
    assert second.registry.get_sample_value("undying_failures_total", {"undying_job": "b", "kind": "hang"}) is None
    assert first.registry.get_sample_value("undying_failures_total", {"undying_job": "a", "kind": "hang"}) == 1


def test_straggler_needs_a_sustained_ten_percent_gap():
    det = StragglerDetector(threshold=1.10, window=5, sustain_s=10.0)
    for _ in range(5):
        for rank in range(4):
            det.observe(rank, 1.3 if rank == 3 else 1.0)
    assert det.ratios()[3] == 1.3
    assert det.evaluate(now=0.0) == (set(), set())  # slow, but not yet for long enough
    assert det.evaluate(now=9.0) == (set(), set())
    assert det.evaluate(now=10.0) == ({3}, {3})
    assert det.evaluate(now=11.0) == ({3}, set())  # flagged once, reported once
    for _ in range(5):
        det.observe(3, 1.0)
    assert det.evaluate(now=12.0) == (set(), set())


def test_noise_below_the_threshold_flags_nobody():
    det = StragglerDetector()
    for i in range(20):
        for rank in range(4):
            det.observe(rank, 1.0 + 0.08 * ((i * 7 + rank * 3) % 5) / 4)  # up to 8% jitter, all ranks
    assert det.evaluate(0.0) == (set(), set()) and det.evaluate(60.0) == (set(), set())


def test_failed_saves_and_the_last_commit_time_are_exported(metrics, monkeypatch):
    # Before the first commit the commit clock reads the job's start, so a job that never commits is seen.
    monkeypatch.setattr("monitor.metrics.time.time", lambda: 1000.0)
    fresh = JobMetrics("fresh")
    assert fresh.registry.get_sample_value("undying_checkpoint_last_commit_timestamp_seconds",
                                           {"undying_job": "fresh"}) == 1000.0
    # A resume keeps the restored commit's time, and this run's start beside it (the alert counts from the later).
    fresh.on_resumed_commit(400.0)
    assert [fresh.registry.get_sample_value(name, {"undying_job": "fresh"}) for name in (
        "undying_checkpoint_last_commit_timestamp_seconds", "undying_run_start_timestamp_seconds")] == [400.0, 1000.0]
    # Its first step moves this run's start to when training began: an hour waiting for nodes, or restoring,
    # put nothing at risk, and must not page at the first step.
    monkeypatch.setattr("monitor.metrics.time.time", lambda: 4600.0)
    fresh.on_step(0, step_s=2.0, tokens=8, loss=1.0, grad_norm=None)
    monkeypatch.setattr("monitor.metrics.time.time", lambda: 4700.0)
    fresh.on_step(1, step_s=2.0, tokens=8, loss=1.0, grad_norm=None)
    assert fresh.registry.get_sample_value("undying_run_start_timestamp_seconds", {"undying_job": "fresh"}) == 4598.0
    assert fresh.registry.get_sample_value("undying_data_wait_seconds_count", {"undying_job": "fresh"}) == 0
    assert fresh.registry.get_sample_value("undying_checkpoint_failures_total", {"undying_job": "fresh"}) == 0
    assert fresh.registry.get_sample_value("undying_checkpoint_skipped_total", {"undying_job": "fresh"}) == 0
    monkeypatch.setattr("monitor.metrics.time.time", lambda: 1234.5)
    port = metrics.serve(HOST, 0)
    metrics.on_checkpoint(20, nbytes=10, blocking_s=0.1, total_s=0.2, interval_s=60.0)
    metrics.on_checkpoint_failed()
    metrics.on_checkpoint_failed()
    metrics.on_checkpoint_skipped(3)
    text = scrape(port)
    assert value(text, "undying_checkpoint_last_commit_timestamp_seconds") == 1234.5
    assert value(text, "undying_checkpoint_failures_total") == 2
    assert value(text, "undying_checkpoint_skipped_total") == 3


def test_goodput_gauges_appear_only_once_the_ledger_is_whole_and_the_counter_from_zero_before():
    # Zeros before a resumed controller carried its predecessor's totals, then the totals, would read
    # as a counter reset and an increase of the job's whole history (the low-goodput alert's false fire).
    # The counter alone is there from the start, at 0: what the resume books is then an increase
    # Prometheus sees (a counter's first sample is not one), also on a new pod's new series.
    resumed = JobMetrics("resumed")
    sample = {"undying_job": "resumed", "cause": "startup"}
    assert resumed.registry.get_sample_value("undying_badput_seconds_total", sample) == 0.0
    assert resumed.registry.get_sample_value("undying_badput_job_seconds", sample) is None
    assert resumed.registry.get_sample_value("undying_productive_seconds", {"undying_job": "resumed"}) is None
    now = [0.0]
    ledger = GoodputLedger(clock=lambda: now[0])
    now[0] = 5.0  # this driver's own start-up
    ledger.carry({"productive": 3600.0, "startup": 60.0})
    resumed.on_goodput(ledger)
    # The counter is this process's (from 0: a predecessor's totals, carried from a snapshot seconds
    # old, are below what it last exported, a counter reset to Prometheus); the job's is a gauge.
    assert resumed.registry.get_sample_value("undying_badput_seconds_total", sample) == 5.0
    assert resumed.registry.get_sample_value("undying_badput_job_seconds", sample) == 65.0
    ledger.enter("data")
    now[0] = 8.0
    resumed.on_goodput(ledger)
    data = {"undying_job": "resumed", "cause": "data"}
    assert resumed.registry.get_sample_value("undying_badput_seconds_total", data) == 3.0
    assert resumed.registry.get_sample_value("undying_badput_seconds_total", sample) == 5.0


def test_the_checkpoint_interval_is_exported_before_any_commit_and_a_resume_keeps_its_commit_time():
    from orchestrator.controller.job_record import JobRecord
    from orchestrator.wire.messages import StepDone

    metrics = JobMetrics("overdue")
    record = JobRecord("overdue", 100, metrics, GoodputLedger(), printer=lambda line: None, progress_every_s=0.0)
    record.checkpoint_interval = lambda: 90.0  # what controller.checkpoints derives (a step cadence's seconds)
    record.on_step(StepDone(step=0, loss=1.0, tokens=8, step_s=0.1, time=0.0))
    assert metrics.registry.get_sample_value("undying_checkpoint_interval_seconds", {"undying_job": "overdue"}) == 90
    metrics.on_resumed_commit(1234.0)
    assert metrics.registry.get_sample_value("undying_checkpoint_last_commit_timestamp_seconds",
                                             {"undying_job": "overdue"}) == 1234.0


def test_a_shrunk_world_drops_the_memory_snapshot_series_of_the_ranks_it_lost():
    metrics = JobMetrics("shrunk")
    metrics.on_memory_snapshot(10, {0: 100, 1: 100, 2: 100, 3: 100})
    metrics.on_layout(2, world_size=2, dp=2, tp=1, pp=1)
    held = {r: metrics.registry.get_sample_value("undying_memory_snapshot_host_bytes",
                                                 {"undying_job": "shrunk", "rank": str(r)}) for r in range(4)}
    assert held == {0: 100, 1: 100, 2: None, 3: None}


def test_goodput_series_count_an_outage_while_it_lasts():
    """Between two readings the controller hands over (a step, a state change), a scrape extends the
    bucket the job is in: a restore that keeps failing shows as it passes, not once training resumes."""
    metrics, clock = JobMetrics("stuck"), FakeClock()
    ledger = GoodputLedger(clock=clock)
    ledger.enter("productive")
    clock.now = 100.0
    metrics.on_goodput(ledger)
    ledger.enter("reformation")  # no step follows: nothing calls on_goodput again
    clock.now = 1900.0

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"undying_job": "stuck", **labels})
    assert sample("undying_badput_seconds_total", cause="reformation") == 1800.0
    assert sample("undying_productive_seconds") == 100.0
    assert sample("undying_goodput_ratio") == pytest.approx(100.0 / 1900.0)
    ledger.stop()
    clock.now = 5000.0  # a stopped ledger's totals are final
    assert sample("undying_badput_seconds_total", cause="reformation") == 1800.0


def test_detection_is_left_out_when_the_failures_onset_is_unknown_and_old_measured_ledgers_go(metrics):
    metrics.on_recovery(detection_s=None, recovery_s=3.0)  # a crash no fault injected: no onset
    metrics.on_recovery(detection_s=0.5, recovery_s=2.0)
    job = {"undying_job": JOB}
    assert metrics.registry.get_sample_value("undying_detection_seconds_count", job) == 1
    assert metrics.registry.get_sample_value("undying_recovery_seconds_count", job) == 2
    metrics.on_memory("measured", {"state": 90, "activation": 40})
    metrics.on_memory("measured", {"state": 80})  # a sharded layout measures the state ledger alone
    measured = {ledger: metrics.registry.get_sample_value("undying_memory_bytes", {**job, "ledger": ledger,
                                                                                     "kind": "measured"})
                for ledger in ("state", "activation")}
    assert measured == {"state": 80, "activation": None}


def test_the_step_series_counts_steps_done_as_the_committed_checkpoint_step_does():
    # "Steps at risk" on the dashboard is undying_step - undying_checkpoint_last_committed_step: 0 right
    # after a commit of the step just trained, never -1.
    from orchestrator.controller.job_record import JobRecord
    from orchestrator.wire.messages import StepDone

    metrics = JobMetrics("risk")
    record = JobRecord("risk", 10, metrics, GoodputLedger(), printer=lambda line: None, progress_every_s=0.0)
    record.on_step(StepDone(step=9, loss=1.0, tokens=8, step_s=0.1, time=0.0))  # the 10th step
    record.on_checkpoint(10, time.time(), 100, 0.1, 0.2, None)  # its save: checkpoint step 10
    value = lambda name: metrics.registry.get_sample_value(name, {"undying_job": "risk"})  # noqa: E731
    assert value("undying_step") - value("undying_checkpoint_last_committed_step") == 0


def test_an_unknown_device_peak_leaves_mfu_unknown_not_nan(tmp_path):
    from orchestrator.controller.telemetry import Telemetry
    from tests.unit.test_controller import _spec

    telemetry = Telemetry(_spec(tmp_path), JobMetrics("unknown-gpu"), heartbeat_s=1.0)
    telemetry.on_restored([{"peak_flops": float("nan")}])  # a rank's GPU that named_peak does not know
    assert telemetry.mfu(1000, 1.0) is None
    telemetry.on_restored([{"peak_flops": 1e12}])
    assert telemetry.mfu(1000, 1.0) > 0


def test_the_badput_counter_never_dips_when_a_scrape_raced_the_close_of_the_open_interval():
    from monitor.goodput_collector import GoodputCollector

    now = [0.0]
    ledger, collector = GoodputLedger(clock=lambda: now[0]), GoodputCollector("race")
    ledger.enter("data")
    collector.publish(ledger.reading())

    def data_seconds() -> float:
        (family,) = [f for f in collector.collect() if f.name == "undying_badput_seconds"]
        return next(s.value for s in family.samples if s.labels["cause"] == "data")

    now[0] = 9.0
    ledger.enter("productive")  # the controller closed the interval at 9 s ...
    now[0] = 10.0
    assert data_seconds() == 10.0  # ... and a scrape of the reading before it ran at 10 s
    collector.publish(ledger.reading())
    assert data_seconds() == 10.0  # not 9: a dip would read as a reset, and increase() count 9 s again
    ledger.enter("data")
    now[0] = 12.0
    collector.publish(ledger.reading())
    assert data_seconds() == 11.0  # the counter goes on once it passes what it exported


def test_a_recovery_that_took_over_a_failed_restore_counts_both_rollbacks_at_its_level():
    from orchestrator.controller.job_record import JobRecord

    metrics = JobMetrics("taken-over")
    record = JobRecord("taken-over", 100, metrics, GoodputLedger(), printer=lambda line: None, progress_every_s=0.0)
    early = record.on_failure("rank_died", 0, detected_at=time.time(), fault_time=None, message="before", step=1)
    early.lost_work_s = 7.0  # before the first commit: its recovery started over from step 0, restoring nothing
    record.on_recovered(early, detected_at=time.time())
    first = record.on_failure("rank_died", 1, detected_at=time.time(), fault_time=None, message="boom", step=5)
    first.lost_work_s = 10.0  # its rollback, booked; then its restore failed
    second = record.on_failure("restore_failed", 0, detected_at=time.time(), fault_time=None, message="again")
    second.lost_work_s = 0.0  # nothing trained since: nothing more to book
    record.on_restored(second, "storage", [], 2.0)
    lost = metrics.registry.get_sample_value("undying_recovery_lost_work_seconds_total",
                                             {"undying_job": "taken-over", "level": "storage"})
    assert lost == 10.0
    third = record.on_failure("rank_died", 1, detected_at=time.time(), fault_time=None, message="later", step=9)
    third.lost_work_s = 3.0
    record.on_restored(third, "memory", [], 0.5)  # the first two are done with: not counted again
    assert metrics.registry.get_sample_value("undying_recovery_lost_work_seconds_total",
                                             {"undying_job": "taken-over", "level": "memory"}) == 3.0
