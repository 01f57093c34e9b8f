"""The controller's timeouts: derived from the measured step time, the cost model's first-step
estimate and the checkpoint's size over the read bandwidth; a number in the spec replaces them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ckpt.storage import Storage
from orchestrator.controller.timeouts import (
    ASSUMED_READ_BPS_PER_RANK,
    BUILD_S,
    Observed,
    Timeouts,
    compute_bound_s,
    derive,
    restore_timeout_s,
)
from orchestrator.spec.job_spec import validate_spec
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec, rendezvous  # noqa: F401


def _job(tmp_path, elastic=None, **over):
    data = {"name": "t", "model": {"preset": "tiny"}, "data": {"seq_len": 16},
            "train": {"steps": 30, "global_batch": 4, "micro_batch": 1}, "parallel": {"dp": 2},
            "checkpoint": {"url": f"file://{tmp_path}/ckpt"}, "elastic": elastic or {}}
    data.update(over)
    return validate_spec(data)


def test_a_tiny_cpu_job_before_any_step_keeps_the_old_hang_floor_and_a_generous_first_step(tmp_path):
    spec = _job(tmp_path)
    limits = derive(spec.elastic, spec, 2, Observed())
    assert (limits.hang_floor_s, limits.hang_factor) == (10.0, 5.0)
    assert limits.first_step_s == 120.0  # the CPU floor: the tiny model's estimate is milliseconds
    assert limits.collective_s == 240.0  # 2 x the first-step limit: the watchdog acts first
    assert limits.release_s == 3.0


def test_measured_steps_scale_the_limits(tmp_path):
    spec = _job(tmp_path)
    limits = derive(spec.elastic, spec, 2, Observed(median_step_s=4.0, first_step_s=50.0))
    assert limits.first_step_s == 150.0  # 3 x the slowest first step measured
    assert limits.release_s == 8.0  # 2 x the median step
    assert limits.collective_s == 300.0
    quick = derive(spec.elastic, spec, 2, Observed(median_step_s=0.05, first_step_s=0.5))
    assert (quick.first_step_s, quick.release_s, quick.collective_s) == (10.0, 3.0, 60.0)  # the floors


def test_a_large_gpu_model_s_five_minute_first_step_is_not_a_hang(tmp_path):
    spec = _job(tmp_path, model={"preset": "llama3.1-8b"}, data={"seq_len": 4096},
                train={"steps": 10, "global_batch": 256, "micro_batch": 1, "precision": "bf16"},
                parallel={"dp": 8, "tp": 8}, resources={"gpus_per_rank": 1})
    bound = compute_bound_s(spec, 64, None)  # the table's slowest GPU, bf16: no rank reported yet
    assert 0.5 < bound < 5.0
    limits = derive(spec.elastic, spec, 64, Observed())
    assert limits.first_step_s >= 600.0 > 300.0
    assert limits.collective_s >= 2 * limits.first_step_s
    # A first step measured short (a warm compile cache, a resume on the same nodes) does not make a
    # replacement's cold compile on another node a hang: on GPU the limit stays at least 120 s.
    assert derive(spec.elastic, spec, 64, Observed(median_step_s=0.5, first_step_s=5.0)).first_step_s == 120.0
    assert derive(spec.elastic, spec, 64, Observed(median_step_s=0.5, first_step_s=60.0)).first_step_s == 180.0
    # The ranks' reported peak replaces the assumed one: a faster GPU, a shorter estimate.
    assert compute_bound_s(spec, 64, 989.5e12) < bound
    assert compute_bound_s(spec, 64, float("nan")) == bound  # an unknown GPU reports NaN


def test_numbers_in_the_spec_replace_every_derived_value(tmp_path):
    elastic = {"hang_timeout_s": 30, "first_step_timeout_s": 900, "collective_timeout_s": 1800,
               "restore_timeout_s": 3600, "release_timeout_s": 20}
    spec = _job(tmp_path, elastic)
    limits = derive(spec.elastic, spec, 2, Observed(median_step_s=100.0, first_step_s=5.0))
    assert (limits.hang_floor_s, limits.hang_factor, limits.first_step_s) == (30.0, 0.0, 900.0)
    assert (limits.collective_s, limits.release_s) == (1800.0, 20.0)
    assert restore_timeout_s(spec.elastic, 2, 10**12, 1.0, 60.0, 120.0) == 3600.0


def test_restore_time_grows_with_the_checkpoint_over_the_read_bandwidth(tmp_path):
    elastic = _job(tmp_path).elastic
    base = 60.0 + BUILD_S + 120.0
    assert restore_timeout_s(elastic, 4, None, None, 60.0, 120.0) == base
    assumed = restore_timeout_s(elastic, 4, 40 * 10**9, None, 60.0, 120.0)
    assert assumed == pytest.approx(base + 3 * 40e9 / (4 * ASSUMED_READ_BPS_PER_RANK))  # 300 s of reads
    assert restore_timeout_s(elastic, 4, 40 * 10**9, 2e9, 60.0, 120.0) == pytest.approx(base + 60.0)


class _Record:
    """The JobRecord surface the timeouts read."""

    def __init__(self):
        self.progress_at, self.steps_s, self.checkpoints, self.generation_stepped = 100.0, [], [], False

    def median_step_s(self):
        return sorted(self.steps_s)[len(self.steps_s) // 2] if self.steps_s else None

    def completed_steps(self):
        return len(self.steps_s)


def test_a_generation_s_first_step_gets_the_first_step_limit_then_the_steady_one(tmp_path):
    spec, record, lines = _job(tmp_path), _Record(), []
    now = [100.0]
    timeouts = Timeouts(spec, record, lambda: None, lines.append, join_s=60.0, retry_budget_s=120.0,
                        clock=lambda: now[0])
    timeouts.for_generation(2)
    timeouts.on_training_started()
    first, steady = "elastic.first_step_timeout_s", "elastic.hang_timeout_s"  # the fields a hang's message names
    assert timeouts.hang_limit() == (120.0, first)  # nothing measured: the first step may take 120 s on CPU
    record.progress_at, record.steps_s, record.generation_stepped = 160.0, [60.0], True  # the first step: 60 s
    assert timeouts.hang_limit() == (300.0, steady) and timeouts.first_step_s == 60.0  # 5 x the median (60 s)
    record.steps_s = [60.0, 0.1, 0.1]
    assert timeouts.hang_limit(saving_s=4.0) == (14.0, steady)  # steady: the floor, and a stop's save on top
    timeouts.on_training_started()  # the next generation: 3 x the first step measured
    record.generation_stepped = False
    now[0] = 170.0  # 10 s into it: a survivor may still be inside that first step for 170 s
    assert timeouts.hang_limit() == (180.0, first) and timeouts.release_s() == 170.0
    assert timeouts.for_generation(2).collective_s == 360.0
    assert timeouts.release_s() == 3.0  # a new generation forming: the failed one's first step is over
    assert len(lines) == 2 and lines[0].startswith("timeouts: hang max(10 s, 5 x median step), first step 120 s")


def test_survivors_still_in_a_generation_s_first_step_are_released_within_what_is_left_of_its_limit(tmp_path):
    # The first step may compile for minutes before its first collective, where a survivor sees the
    # release: killed after 3 s, every survivor would need a replacement and lose what it holds.
    now = [100.0]
    spec, record = _job(tmp_path), _Record()
    timeouts = Timeouts(spec, record, lambda: None, print, join_s=60.0, retry_budget_s=120.0, clock=lambda: now[0])
    timeouts.for_generation(2)
    timeouts.on_training_started()  # at 100 s; the first step's limit: 120 s on CPU
    now[0] = 130.0  # a rank died 30 s into the first step
    assert timeouts.release_s() == 90.0
    now[0] = 219.0  # a hang found at the limit: nothing left to wait for
    assert timeouts.release_s() == 3.0
    record.progress_at, record.steps_s, record.generation_stepped = 140.0, [40.0], True
    now[0] = 150.0
    assert timeouts.release_s() == 80.0  # stepped: two steps' time
    fixed = Timeouts(_job(tmp_path, elastic={"release_timeout_s": 5.0}), _Record(), lambda: None, print,
                     join_s=60.0, retry_budget_s=120.0, clock=lambda: now[0])
    fixed.on_training_started()
    assert fixed.release_s() == 5.0  # the spec's number stands


def test_a_validation_owed_before_the_first_step_leaves_it_the_first_step_limit_counted_from_its_end(tmp_path):
    spec, record = _job(tmp_path), _Record()
    timeouts = Timeouts(spec, record, lambda: None, print, join_s=60.0, retry_budget_s=120.0)
    timeouts.for_generation(2)
    timeouts.on_training_started()
    record.progress_at = 150.0  # the validation owed at the restored step ended: no step yet
    assert timeouts.hang_limit() == (120.0, "elastic.first_step_timeout_s")
    record.progress_at, record.steps_s, record.generation_stepped = 160.0, [10.0], True
    timeouts.hang_limit()
    assert timeouts.first_step_s == 10.0  # the step's own time, not the validation's 50 s before it


def test_the_restore_measures_the_read_bandwidth_from_storage_only(tmp_path):
    spec = _job(tmp_path)
    timeouts = Timeouts(spec, _Record(), lambda: None, print, join_s=60.0, retry_budget_s=0.0)
    timeouts.on_restored([{"storage_read_bytes": 10**9}, {"storage_read_bytes": 10**9}], 2.0, from_storage=False)
    assert timeouts.read_bytes_per_s is None  # a memory snapshot's restore says nothing of the store
    timeouts.on_restored([{"storage_read_bytes": 10**9}, {"storage_read_bytes": 10**9}], 2.0, from_storage=True)
    assert timeouts.read_bytes_per_s == 1e9
    assert timeouts.restore_s(2, 10**10) == pytest.approx(60.0 + BUILD_S + 30.0)
    record = _Record()
    record.checkpoints = [SimpleNamespace(step=10, bytes=123)]
    sizes = Timeouts(spec, record, lambda: None, print, join_s=60.0, retry_budget_s=0.0)
    assert sizes.checkpoint_bytes(10, lambda step: 1 / 0) == 123
    assert sizes.checkpoint_bytes(20, lambda step: SimpleNamespace(total_bytes=456)) == 456
    assert sizes.checkpoint_bytes(30, lambda step: 1 / 0) is None  # left for the ranks to report


def test_the_controller_logs_its_timeouts_and_forms_the_group_with_the_collective_timeout(tmp_path, rendezvous):  # noqa: F811
    spec = _spec(tmp_path)
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    lines: list[str] = []
    ctl = _controller(spec, workers, rendezvous, lines)
    ctl.step_once()
    ctl.step_once()
    [line] = [line for line in lines if "timeouts:" in line]
    assert "process group 240 s" in line and "release 0.5 s" in line  # the test's fixed release
    assert workers.collective_timeout_s == 240.0


class _RecordingWorkers(FakeWorkerGroup):
    def restore_all(self, step, dp, timeout_s, faults=None):
        self.restore_timeouts = [*getattr(self, "restore_timeouts", []), (step, timeout_s)]
        return super().restore_all(step, dp, timeout_s, faults)


def test_the_restore_after_a_failure_is_given_time_for_the_checkpoint_s_bytes(tmp_path, rendezvous):  # noqa: F811
    spec = _spec(tmp_path)
    workers = _RecordingWorkers(rendezvous, Storage(spec.checkpoint_root), die_at={25: 1})
    report = _controller(spec, workers, rendezvous, []).run()
    assert report.status == "succeeded"
    (fresh, first), (step, restore) = workers.restore_timeouts
    committed = next(c.bytes for c in report.checkpoints if c.step == 20)
    assert fresh is None and first == 60.0 + BUILD_S + spec.checkpoint.read_retry_s
    assert committed > 0 and step == 20
    assert restore - first == pytest.approx(3 * committed / (2 * ASSUMED_READ_BPS_PER_RANK), rel=1e-6)


def test_a_shrink_scales_the_measured_step_time_at_once_and_a_grow_never_scales_it_down():
    import time

    from monitor.goodput import GoodputLedger
    from monitor.metrics import JobMetrics
    from orchestrator.controller.job_record import JobRecord
    from orchestrator.wire.messages import StepDone

    record = JobRecord("t", 100, JobMetrics("t"), GoodputLedger(), printer=lambda _: None)
    record.on_layout(0, 4, 4, 1, 1)
    for step in range(10):
        record.on_step(StepDone(step, 1.0, 64, 0.5, time.time()))
    assert record.median_step_s() == 0.5
    record.on_layout(1, 1, 1, 1, 1)  # dp 4 -> 1 with the global batch kept: each rank's share is 4x
    assert record.median_step_s() == 2.0  # before the first step of dp 1 (its hang and release limits)
    for step in range(10, 13):
        record.on_step(StepDone(step, 1.0, 64, 2.2, time.time()))
    assert record.median_step_s() == 2.0
    record.on_layout(2, 2, 2, 1, 1)  # a grow to dp 2: dp 4's steps scaled by 2, dp 1's not scaled down
    assert record.median_step_s(last=13) == 1.0
    assert record.median_step_s(last=3) == 2.2  # (a wider dp's collectives cost more: kept long, not halved)


@pytest.mark.parametrize(("elastic", "over", "field", "words"), [
    ({"collective_timeout_s": 150, "first_step_timeout_s": 60},
     {"data": {"seq_len": 16, "source": "tokens", "path": "/nowhere", "read_retry_s": 140}},
     "elastic.collective_timeout_s", "not above data.read_retry_s + the hang limit (140 + 10 s)"),
    ({"collective_timeout_s": 100}, {}, "elastic.collective_timeout_s",
     "not above the automatic first-step limit, at least 120 s on cpu"),
    ({"restore_timeout_s": 60}, {"checkpoint": {"url": "file:///tmp/x", "read_retry_s": 120}},
     "elastic.restore_timeout_s", "60 s is not above checkpoint.read_retry_s (120 s)"),
])
def test_an_explicit_timeout_shorter_than_a_wait_the_spec_allows_is_refused(tmp_path, elastic, over, field, words):
    from orchestrator.spec.problems import SpecError

    with pytest.raises(SpecError) as caught:
        _job(tmp_path, elastic, **over)
    [problem] = [p for p in caught.value.problems if p.field == field]
    assert words in problem.message and "leave it auto" in problem.message


def test_explicit_timeouts_that_cover_those_waits_are_taken(tmp_path):
    _job(tmp_path, {"collective_timeout_s": 100, "first_step_timeout_s": 60})  # the first step's own limit
    _job(tmp_path, {"collective_timeout_s": 121, "restore_timeout_s": 121})
