"""Clocks: the hang watchdog runs on the monotonic clock, and rank timestamps are put on the
controller's clock before an interval subtracts them."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from ckpt.storage import Storage
from orchestrator.controller.clock_skew import ClockSkew
from orchestrator.controller.intake import EventIntake
from orchestrator.controller.states import State
from orchestrator.wire.messages import FaultFired, NodeLost, ShardWritten, StepDone
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec, rendezvous  # noqa: F401

HOUR = 3600.0


class _QuietWorkers(FakeWorkerGroup):
    """Ranks that train and say nothing yet: no step, no outcome (a long first step)."""

    def wait_any(self, timeout_s):
        return []


class _Clocks:
    """The `time` module as the controller's modules see it, with either clock moved ahead
    (torch's store client keeps the real one)."""

    def __init__(self):
        self.wall_ahead_s = self.monotonic_ahead_s = 0.0

    def time(self) -> float:
        return time.time() + self.wall_ahead_s

    def monotonic(self) -> float:
        return time.monotonic() + self.monotonic_ahead_s

    def __getattr__(self, name):
        return getattr(time, name)


def _controller_clocks(monkeypatch) -> _Clocks:
    from orchestrator.controller import blame, clock_skew, job_record, machine

    clocks = _Clocks()
    for module in (blame, clock_skew, job_record, machine):
        monkeypatch.setattr(module, "time", clocks)
    return clocks


def test_a_wall_clock_step_never_trips_the_hang_watchdog(tmp_path, rendezvous, monkeypatch):  # noqa: F811
    spec = _spec(tmp_path)
    ctl = _controller(spec, _QuietWorkers(rendezvous, Storage(spec.checkpoint_root)), rendezvous, [])
    clocks = _controller_clocks(monkeypatch)
    while ctl.state != State.RUNNING:
        ctl.step_once()
    clocks.wall_ahead_s = HOUR  # NTP steps the wall clock an hour ahead
    for _ in range(5):  # polls of the training loop (step_once would poll until the state changes)
        ctl.HANDLERS[State.RUNNING]()
        assert ctl.state == State.RUNNING
    clocks.monotonic_ahead_s = HOUR  # an hour of real silence is a hang
    ctl.HANDLERS[State.RUNNING]()
    assert ctl.state == State.RECOVERING
    assert ctl.phase.failure.kind == "hang" and "no step for 36" in ctl.phase.failure.message
    assert "s, elastic.first_step_timeout_s)" in ctl.phase.failure.message  # no first step came: that limit


def test_one_hosts_timestamps_pass_unchanged():
    skew = ClockSkew()
    assert skew.local(3, 100.0, received=100.004) == 100.0
    assert skew.local(3, 200.0, received=200.5) == 200.0
    assert skew.ahead_s == {3: 0.0}


def test_a_rank_clock_ahead_is_taken_back_to_within_one_message_latency():
    skew, ahead = ClockSkew(), 50.0
    # Rank 1's clock is 50 s ahead; its messages take 2 to 9 ms.
    for true_sent, latency in ((10.0, 0.009), (11.0, 0.002), (12.0, 0.005)):
        skew.local(1, true_sent + ahead, received=true_sent + latency)
    fired = skew.local(1, 20.0 + ahead, received=20.3)  # a fault notice drained 0.3 s after it fired
    assert 20.0 <= fired <= 20.002 + 1e-9  # off by at most the fastest message's latency
    assert skew.local(0, 5.0, received=5.001) == 5.0  # other ranks keep their own bound


def test_messages_get_the_controllers_clock_before_any_handler():
    skew = ClockSkew(clock=lambda: 1000.0)
    step = skew.to_local(StepDone(step=4, loss=1.0, tokens=8, step_s=0.1, time=1000.0 + HOUR))
    fault = skew.to_local(FaultFired(7, "kill_rank", time=1000.0 + HOUR, rank=2))
    lost = skew.to_local(NodeLost("n1", 3, time=999.5))
    assert (step.time, fault.time, lost.time) == (1000.0, 1000.0, 999.5)
    assert fault.fault_id == 7 and fault.rank == 2 and not fault.handled
    untimed = FaultFired(8, "storage_error")  # the controller's own notices and untimed ones pass
    assert skew.to_local(untimed) is untimed
    receipt = object.__new__(ShardWritten)
    assert skew.to_local(receipt) is receipt


class _Queue:
    """A generation's store, holding the messages its ranks queued."""

    def __init__(self, *messages):
        self.messages = list(messages)

    def receive(self):
        out, self.messages = self.messages, []
        return out


def test_a_new_generation_forgets_the_bounds_learned_from_the_old_hosts():
    """Rank 0's host runs an hour ahead; after a re-formation rank 0 is on a host with the right time."""
    steps: list[StepDone] = []
    chaos = SimpleNamespace(drain=list, on_step=lambda step: None)
    record = SimpleNamespace(on_step=steps.append, on_eval=None)
    intake = EventIntake(record, None, chaos, None, None, print, on_receipt=None)
    intake.clocks.clock = lambda: 1000.0

    def step_done(step, sent):
        return StepDone(step=step, loss=1.0, tokens=8, step_s=0.1, time=sent)

    old = _Queue()
    for step in (1, 2):
        old.messages.append(step_done(step, 1000.0 + HOUR))
        intake.drain(old)
    intake.drain(_Queue(step_done(3, 999.0)))
    assert [s.time for s in steps] == [1000.0, 1000.0, 999.0]  # not an hour before it was sent


@pytest.mark.parametrize("rank_ahead_s", [0.0, HOUR])
def test_detection_is_measured_on_one_clock(tmp_path, rendezvous, rank_ahead_s):  # noqa: F811
    """A rank whose clock runs an hour ahead reports a fault: its detection time stays a few
    milliseconds, not minus an hour, and the fault is taken as the failure's cause."""

    class AheadWorkers(FakeWorkerGroup):
        def inject(self, rank, fault):
            self.gen_store.push_event({"type": "fault", "fault_id": fault.id, "kind": fault.kind, "rank": rank,
                                       "step": self.next_step, "point": "timed", "time": time.time() + rank_ahead_s})
            self.die_at[self.next_step] = rank

    spec = _spec(tmp_path, chaos={"faults": [{"kind": "kill_rank", "rank": 1, "at_seconds": 0}]})
    ctl = _controller(spec, AheadWorkers(rendezvous, Storage(spec.checkpoint_root)), rendezvous, [])
    report = ctl.run()
    assert report.status == "succeeded", report.error
    [fired] = ctl.fault_clock.fired.values()
    assert fired.time <= time.time()  # not an hour in the controller's future
    [failure] = report.failures
    assert failure.kind == "kill_rank" and 0.0 <= failure.detected_after_s < 5.0
    assert report.goodput.badput_s["detection"] < 5.0



def test_a_drain_whose_landed_commits_end_the_job_still_takes_its_records_first():
    # The lane's commits are booked before the drain's handlers; one that ends the job (its run of
    # failed saves) must not leave this drain's step records in the store, unread by the report.
    from orchestrator.controller.save_failures import SavesFailing

    steps: list[StepDone] = []
    calls = iter([SavesFailing("3 consecutive saves failed"), []])

    def landed():
        outcome = next(calls)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    chaos = SimpleNamespace(drain=list, on_step=lambda step: None)
    record = SimpleNamespace(on_step=steps.append, on_eval=None)
    intake = EventIntake(record, None, chaos, None, None, print, on_receipt=None, landed=landed)
    with pytest.raises(SavesFailing, match="3 consecutive"):
        intake.drain(_Queue(StepDone(step=7, loss=1.0, tokens=8, step_s=0.1, time=0.0)))
    assert [s.step for s in steps] == [7]
