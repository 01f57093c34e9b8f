"""GoodputLedger: exact bookkeeping of wall time under a fake clock."""

from __future__ import annotations

import random

import pytest

from monitor.goodput import BADPUT_CAUSES, BUCKETS, PRODUCTIVE, GoodputLedger
from orchestrator.wire.messages import StepDone


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_buckets_are_productive_plus_the_taxonomy():
    assert (PRODUCTIVE, *BADPUT_CAUSES) == BUCKETS
    assert BADPUT_CAUSES == (
        "startup",
        "checkpoint_save",
        "checkpoint_restore",
        "detection",
        "reformation",
        "lost_work",
        "waiting_for_resources",
        "data",
        "other",
    )


def test_time_is_booked_to_the_bucket_that_was_open():
    clock = FakeClock()
    ledger = GoodputLedger(clock=clock)
    clock.advance(3)  # before the first enter: start-up
    ledger.enter("productive")
    clock.advance(10)
    ledger.enter("detection")
    clock.advance(2)  # still open: totals() must include it
    totals = ledger.totals()
    assert totals["startup"] == 3
    assert totals["productive"] == 10
    assert totals["detection"] == 2
    assert ledger.current == "detection"
    assert ledger.wall() == 15
    assert ledger.badput()["detection"] == 2 and PRODUCTIVE not in ledger.badput()


@pytest.mark.parametrize("seed", range(20))
def test_buckets_sum_to_wall_exactly_under_any_sequence(seed):
    rng = random.Random(seed)
    clock = FakeClock()
    # Quarter-second ticks are exact in binary floating point, so equality is exact, not approximate.
    carried = {bucket: rng.randint(0, 40) / 4 for bucket in BUCKETS}
    ledger = GoodputLedger(clock=clock, carried=carried)
    elapsed = 0.0
    for _ in range(200):
        tick = rng.randint(0, 40) / 4
        clock.advance(tick)
        elapsed += tick
        if rng.random() < 0.6:
            ledger.enter(rng.choice(BUCKETS))
        else:
            ledger.move(rng.randint(0, 80) / 4, rng.choice(BUCKETS), rng.choice(BUCKETS))
        totals = ledger.totals()
        assert sum(totals.values()) == ledger.wall() == sum(carried.values()) + elapsed
        assert all(seconds >= 0 for seconds in totals.values())


def test_move_reattributes_and_clamps_to_what_src_holds():
    clock = FakeClock()
    ledger = GoodputLedger(clock=clock)
    ledger.enter("productive")
    clock.advance(5)
    ledger.enter("other")
    assert ledger.move(2, "productive", "checkpoint_save") == 2
    assert ledger.move(10, "productive", "lost_work") == 3  # only 3 s left in productive
    assert ledger.move(1, "productive", "lost_work") == 0
    totals = ledger.totals()
    assert totals["productive"] == 0
    assert totals["checkpoint_save"] == 2
    assert totals["lost_work"] == 3
    assert ledger.wall() == 5


def test_move_counts_the_open_interval_of_src():
    clock = FakeClock()
    ledger = GoodputLedger(clock=clock)
    ledger.enter("productive")
    clock.advance(4)  # productive is still open
    assert ledger.move(3, "productive", "checkpoint_save") == 3
    clock.advance(1)
    assert ledger.totals()["productive"] == 2
    assert ledger.current == "productive"


def test_invalid_arguments_are_refused_with_the_bucket_list():
    ledger = GoodputLedger(clock=FakeClock())
    with pytest.raises(ValueError, match="waiting_for_resources"):
        ledger.enter("idle")
    with pytest.raises(ValueError, match="unknown goodput bucket"):
        ledger.move(1, "productive", "idle")
    with pytest.raises(ValueError, match=">= 0"):
        ledger.move(-1, "productive", "other")
    with pytest.raises(ValueError, match="unknown goodput bucket"):
        GoodputLedger(clock=FakeClock(), carried={"idle": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        GoodputLedger(clock=FakeClock(), carried={"other": float("nan")})


def test_carried_totals_add_to_every_bucket_and_to_wall():
    clock = FakeClock()
    first = GoodputLedger(clock=clock)
    first.enter("productive")
    clock.advance(30)
    first.move(6, "productive", "checkpoint_save")
    saved = first.to_dict()
    assert set(saved) == set(BUCKETS)

    # A new controller process after a crash: a different clock origin, the saved totals carried.
    resumed_clock = FakeClock(now=5.0)
    resumed = GoodputLedger(clock=resumed_clock, carried=saved)
    assert resumed.totals() == saved
    assert resumed.wall() == 30
    resumed_clock.advance(4)  # start-up of the new controller
    resumed.enter("checkpoint_restore")
    resumed_clock.advance(2)
    resumed.enter("productive")
    resumed_clock.advance(10)
    totals = resumed.totals()
    assert totals["startup"] == 4
    assert totals["checkpoint_restore"] == 2
    assert totals["productive"] == 24 + 10
    assert totals["checkpoint_save"] == 6
    assert resumed.wall() == 46 == sum(totals.values())


def test_goodput_ratio():
    clock = FakeClock()
    ledger = GoodputLedger(clock=clock)
    assert ledger.goodput() == 0.0  # no time has passed: no division by zero
    clock.advance(1)
    ledger.enter("productive")
    clock.advance(3)
    assert ledger.goodput() == 0.75
    ledger.move(1, "productive", "lost_work")
    assert ledger.goodput() == 0.5


def test_stop_freezes_wall_and_totals():
    clock = FakeClock()
    ledger = GoodputLedger(clock=clock)
    ledger.enter("productive")
    clock.advance(8)
    ledger.stop()
    clock.advance(100)
    assert ledger.current is None
    assert ledger.wall() == 8 == ledger.totals()["productive"]
    ledger.stop()  # idempotent: the controller may stop on both SUCCEEDED and shutdown
    assert ledger.move(2, "productive", "lost_work") == 2  # late-learned costs still move
    assert ledger.wall() == 8 == sum(ledger.totals().values())
    with pytest.raises(RuntimeError, match="stopped"):
        ledger.enter("productive")


def _step(record, step: int, step_s: float, end: float) -> float:
    record.on_step(StepDone(step=step, loss=1.0, tokens=10, step_s=step_s, time=end))
    return end


def _lost_from_report(report, failure_index: int = 0) -> float:
    """monitor.goodput's definition of lost work, applied to the report alone."""
    failure = report.failures[failure_index]
    fault_at = failure.time - failure.detected_after_s
    last_end = max(r.finished_at for r in report.rolled_back)
    return sum(r.step_s for r in report.rolled_back) + max(0.0, fault_at - last_end)


def test_lost_work_is_the_thrown_away_executions_plus_the_interrupted_step():
    """What the controller books as lost_work at recovery (JobRecord.rolled_back_seconds) is
    what the report later lists as thrown away, whatever the second executions cost."""
    from monitor.metrics import JobMetrics
    from orchestrator.controller.job_record import JobRecord

    record = JobRecord("unit", 20, JobMetrics("unit"), GoodputLedger(clock=FakeClock()), printer=lambda _: None)
    t = record.started
    for step in range(13):  # generation 0: steps 0..12, then step 13 is killed half-way
        t = _step(record, step, 0.5 + 0.01 * step, t + 0.5 + 0.01 * step + 0.02)
    fault_at = t + 0.3
    record.on_failure("kill_rank", 1, detected_at=fault_at + 0.05, fault_time=fault_at, message="killed", step=13)
    lost = record.rolled_back_seconds(10, since=record.started, failed_at=fault_at)
    assert lost == pytest.approx(0.60 + 0.61 + 0.62 + 0.3)
    t = fault_at + 5.0  # generation 1 restores step 10 and redoes 10..13 twice as slowly
    for step in range(10, 20):
        t = _step(record, step, 1.2, t + 1.2)
    report = record.report("succeeded", 20)
    assert [r.step for r in report.rolled_back] == [10, 11, 12]
    assert report.redone_steps == 4 and report.redone_s == pytest.approx(4 * 1.2)
    assert _lost_from_report(report) == pytest.approx(lost, abs=1e-6)


def _thirteen_steps():
    """(ledger, record, the end of step 12) after steps 0..12 of 0.5 s each, the ledger holding enough
    productive time for the moves a test makes."""
    from monitor.metrics import JobMetrics
    from orchestrator.controller.job_record import JobRecord

    clock = FakeClock()
    ledger = GoodputLedger(clock=clock)
    ledger.enter("productive")
    record = JobRecord("unit", 20, JobMetrics("unit"), ledger, printer=lambda _: None)
    t = record.started
    for step in range(13):
        t = _step(record, step, 0.5, t + 0.5)
    clock.advance(100)
    return ledger, record, t


def test_the_interrupted_step_s_time_leaves_out_a_validation_and_a_save_booked_after_the_last_step():
    """A validation (2 s, booked to `other`) and a save's blocking (0.5 s, booked to checkpoint_save)
    ran after step 12; the fault came 2.8 s after step 12 ended: 0.3 s of step 13 was lost, not 2.8 s."""
    from orchestrator.wire.messages import EvalDone

    ledger, record, t = _thirteen_steps()
    record.on_save_blocking(13, ledger.move(0.5, "productive", "checkpoint_save"))
    record.on_eval(EvalDone(step=13, loss=1.0, tokens=10, seconds=2.0))
    assert record.rolled_back_seconds(10, since=record.started, failed_at=t + 2.8) == pytest.approx(3 * 0.5 + 0.3)
    record.on_save_blocking(10, 7.0)  # an older save's blocking lies before the last step: not in its tail
    assert record.rolled_back_seconds(10, since=record.started, failed_at=t + 2.8) == pytest.approx(3 * 0.5 + 0.3)
    _step(record, 13, 0.5, t + 3.0)  # a newer step: nothing is booked after it yet
    assert record.rolled_back_seconds(10, since=record.started, failed_at=t + 3.2) == pytest.approx(4 * 0.5 + 0.2)


@pytest.mark.parametrize("receipts_first", [True, False])
def test_a_fault_inside_a_save_s_blocking_is_booked_once(receipts_first):
    """Step 12 ended at t; its save blocked the ranks 2 s (t..t+2); a rank was killed at t+0.5 and the
    kill detected at t+3. [t, t+2] is the save's, [t+2, t+3] the detection's, whichever the controller
    learned first (the survivors' receipts may come before or after it sees the death), and nothing
    of the step in flight was lost: 3 s off productive in all, not 4.5."""
    ledger, record, t = _thirteen_steps()
    if receipts_first:
        record.book_save_blocking(ledger, 13, 2.0)
    record.book_detection(ledger, since=t + 0.5, detected_at=t + 3.0)
    if not receipts_first:
        record.book_save_blocking(ledger, 13, 2.0)
    totals = ledger.totals()
    assert totals["checkpoint_save"] + totals["detection"] == pytest.approx(3.0)
    assert totals["checkpoint_save"] == pytest.approx(2.0 if receipts_first else 0.5)  # (the first booked it)
    assert record.rolled_back_seconds(13, since=record.started, failed_at=t + 0.5) == 0.0  # nothing in flight


def test_a_second_failure_loses_the_running_generation_s_redone_steps_only():
    """Generation 0 reached step 18 and lost 10..18; generation 1 redid 10..14 and failed in 15: its
    lost work is 10..14 and the part of 15 it ran, not generation 0's records of 15..18."""
    from monitor.metrics import JobMetrics
    from orchestrator.controller.job_record import JobRecord

    record = JobRecord("unit", 40, JobMetrics("unit"), GoodputLedger(clock=FakeClock()), printer=lambda _: None)
    t = record.started
    for step in range(19):
        t = _step(record, step, 0.5, t + 0.5)
    record.on_training_started()
    since = t = t + 1.0  # the steps' clock is this test's: generation 1 starts after generation 0's last step
    for step in range(10, 15):
        t = _step(record, step, 0.7, t + 0.7)
    assert record.rolled_back_seconds(10, since=since, failed_at=t + 0.2) == pytest.approx(5 * 0.7 + 0.2)
    assert record.rolled_back_seconds(13, since=since) == pytest.approx(2 * 0.7)
    assert record.on_training_started() and record.rolled_back_seconds(10, since=t + 1, failed_at=t + 1.5) == \
        pytest.approx(0.5)  # a generation that reported no step lost the time since its start


def test_a_failure_after_a_rollback_is_marked_at_the_running_generation_s_step():
    """Generation 1 restored step 10 and redid 10 and 11 when it failed: the failure is at step 11
    on the loss curve, not at step 12, the furthest generation 0 had reached."""
    from monitor.metrics import JobMetrics
    from orchestrator.controller.blame import Blame
    from orchestrator.controller.job_record import JobRecord

    record = JobRecord("unit", 20, JobMetrics("unit"), GoodputLedger(clock=FakeClock()), printer=lambda _: None)
    assert record.on_failure("kill_rank", 0, detected_at=record.started + 1, fault_time=None, message="x").step is None
    t = record.started + 1
    for step in range(13):
        t = _step(record, step, 0.5, t + 0.5)
    first = record.on_failure("kill_rank", 1, detected_at=t + 0.1, fault_time=t, message="killed", step=13)
    t += 5.0
    for step in (10, 11):
        t = _step(record, step, 0.5, t + 0.5)
    # The step a failure interrupts is the running generation's next one (else a step generation 1
    # never began would count as in flight, and its first execution as redone).
    assert Blame(None, record).current_step() == 12
    second = record.on_failure("kill_rank", 2, detected_at=t + 0.1, fault_time=t, message="killed", step=12)
    assert (first.step, second.step) == (12, 11)


def test_carry_adds_a_predecessors_totals_to_buckets_and_wall_alike():
    clock = FakeClock()
    ledger = GoodputLedger(clock=clock)
    clock.advance(2)
    ledger.enter("productive")
    clock.advance(3)
    ledger.carry({"productive": 10.0, "lost_work": 4.0})
    clock.advance(1)
    totals = ledger.totals()
    assert totals["startup"] == 2 and totals["productive"] == 14 and totals["lost_work"] == 4
    assert ledger.wall() == 20 == sum(totals.values()) and ledger.current == "productive"
    with pytest.raises(ValueError, match="need >= 0"):
        ledger.carry({"productive": -1.0})


def test_the_step_time_now_is_measured_on_the_newest_executions_only():
    from monitor.metrics import JobMetrics
    from orchestrator.controller.job_record import RECENT_STEPS, JobRecord
    from orchestrator.wire.messages import StepDone

    record = JobRecord("unit", 10_000, JobMetrics("unit"), GoodputLedger(clock=FakeClock()), printer=lambda _: None)
    for step in range(3 * RECENT_STEPS):
        step_s = 1.0 if step < 2 * RECENT_STEPS else 0.25  # the job got faster
        record.on_step(StepDone(step=step, loss=1.0, tokens=10, step_s=step_s, time=float(step)))
    assert len(record.recent) == RECENT_STEPS  # bounded, however long the job
    assert record.median_step_s() == 0.25 and record.recent_step_times() == [0.25] * RECENT_STEPS
