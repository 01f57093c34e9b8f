"""Preemption (SIGTERM/SIGINT) and node drain in the controller, with the fake worker group.

The fake ranks read the checkpoint plan at every step boundary, as real ones do, so a stop
step the controller publishes is saved and ends their `train` call there. Signals are
delivered by calling the controller's handler (`Stops.on_signal`) at a chosen step.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from ckpt.catalog import Catalog
from ckpt.storage import Storage
from monitor.metrics import JobMetrics
from orchestrator.cluster.interruptible import Interrupted
from orchestrator.cluster.worker_group import RankOutcome
from orchestrator.controller.machine import Controller
from orchestrator.controller.states import State
from orchestrator.controller.stopping import RECEIPTS_S, Stops, stop_lead
from orchestrator.wire.messages import CheckpointPlan, NodeLost
from orchestrator.wire.store import PLAN, RendezvousServer
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec

STEPS = 100
STEP_S = 0.01  # the fake ranks' step time (their step records say so too)


@pytest.fixture
def rendezvous():
    return RendezvousServer("127.0.0.1")


class SignallingWorkers(FakeWorkerGroup):
    """Calls `at[step]()` when a rank reaches `step` (a signal arriving mid-training)."""

    def __init__(self, *args, at: dict | None = None, nodes: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.at = dict(at or {})
        self.nodes = dict(nodes or {})  # rank -> node (default "head")
        self.forgotten: list[str] = []
        self.fail_stop_save = False  # rank 1's shard of the first stop step fails
        self.stall_at_stop = False  # generation 0's ranks hang once a stop step is published
        self.on_stall = lambda: None  # called at their first poll hung
        self.spare_nodes: set[str] = set()  # nodes the warm spares run on

    def spares_on(self, node):
        return len(self.spares) if node in self.spare_nodes else 0

    def drop_spares_on(self, nodes):
        if not set(nodes) & self.spare_nodes:
            return 0
        dropped, self.spares[:] = len(self.spares), []
        return dropped

    def _stop_at(self, store) -> int | None:
        return CheckpointPlan.from_json(store.get_json(PLAN)).stop_at

    def save_shards(self, store, step, world):
        if self.fail_stop_save and self._stop_at(store) == step:
            self.fail_stop_save = False
            self.fail_shard[step] = 1
            super().save_shards(store, step, world)
            del self.fail_shard[step]
        else:
            super().save_shards(store, step, world)

    def _train(self):
        if self.stall_at_stop and self.gen == 0 and self._stop_at(self.rendezvous.generation(self.gen)) is not None:
            self.on_stall()
            self.on_stall = lambda: None
            return []  # hung before the stop step
        due = sorted(s for s in self.at if s >= self.next_step)
        if due and due[0] < self.until:  # train up to the hook's step, fire it, go on
            until, self.until = self.until, due[0]
            out = super()._train()
            self.until = until
            if self.next_step == due[0]:
                self.at.pop(due[0])()
                self._running = self._running or set(self.actors)
                return [o for o in out if o.status != "done"]
            return out
        return super()._train()

    def node_of(self, rank):
        return self.nodes.get(rank, "head")

    def forget_node(self, node):
        self.forgotten.append(node)
        ranks = [r for r in sorted(self.actors) if self.node_of(r) == node]
        for rank in ranks:
            self.actors.pop(rank)
            self._running.discard(rank)
        return ranks


class WallClockRanks(SignallingWorkers):
    """Ranks that train on the wall clock, one step per STEP_S whatever the controller is doing,
    and read the plan at every step boundary. A poll catches up on the steps due since the last
    one; a plan published in between is taken as published just now (the worst case): only the
    last boundary reads it. `late`: the steps at which a rank read a stop step it had passed."""

    def start_training(self, until_step, faults, **kwargs):
        super().start_training(until_step, faults, **kwargs)
        self.t0, self.first, self.late = time.monotonic(), self.next_step, []
        self.seen = self._plan()

    def _plan(self) -> CheckpointPlan:
        return CheckpointPlan.from_json(self.rendezvous.generation(self.gen).get_json(PLAN))

    def _train(self):
        store, newest = self.rendezvous.generation(self.gen), self._plan()
        due = min(self.until, self.first + int((time.monotonic() - self.t0) / STEP_S))
        stopped = False
        while self.next_step < due and not stopped:
            plan = newest if self.next_step + 1 == due else self.seen
            self.push_step(store, self.next_step)
            self.next_step += 1
            stopped = plan.stops(self.next_step)
            if plan.should_save(self.next_step) or stopped:
                self.save_shards(store, self.next_step, len(self.actors))
            if stopped and self.next_step > plan.stop_at:
                self.late.append(self.next_step)
        self.seen = newest
        if not stopped and self.next_step < self.until:
            return []
        done = [RankOutcome(r, "done", {}) for r in sorted(self._running)]
        self._running.clear()
        return done


def _run(tmp_path, rendezvous, spec=None, **workers_kwargs):
    spec = spec or _spec(tmp_path, train={"steps": STEPS, "global_batch": 4, "micro_batch": 1})
    lines: list[str] = []
    workers = SignallingWorkers(rendezvous, Storage(spec.checkpoint_root), **workers_kwargs)
    ctl = _controller(spec, workers, rendezvous, lines)
    return ctl, workers, lines


def test_sigterm_checkpoints_at_the_next_boundary_and_the_rerun_redoes_nothing(tmp_path, rendezvous):
    box = {}
    ctl, workers, lines = _run(tmp_path, rendezvous, at={23: lambda: box["ctl"].stops.on_signal(signal.SIGTERM)})
    box["ctl"] = ctl
    report = ctl.run()
    stop = ctl.checkpoints.stop_at  # past step 23 by the lead, and by the steps a poll may have missed
    assert stop >= 23 + stop_lead(0.01)
    assert ctl.state == State.PREEMPTED and report.status == "preempted", report.error
    assert ctl.catalog.committed_steps()[-1] == stop and report.final_step == stop
    assert max(p.step for p in report.losses) + 1 == stop  # nothing trained past the commit
    assert any("RUNNING -> STOPPING: SIGTERM at step 23" in line for line in lines)
    assert "rerun the job to resume" in report.error
    rerun_workers = FakeWorkerGroup(rendezvous, Storage(ctl.spec.checkpoint_root))
    rerun = _controller(ctl.spec, rerun_workers, rendezvous, [])
    again = rerun.run()
    assert again.status == "succeeded" and again.final_step == STEPS
    assert min(p.step for p in again.losses) == stop and again.redone_steps == 0


def test_a_signal_at_the_end_whose_final_save_fails_is_still_a_preemption(tmp_path, rendezvous):
    """The stop step is the last one (clamped to train.steps) and its save fails: exit 75, so a
    scheduler that retries preempted jobs resumes it, not exit 1 as a failed job."""
    box = {}
    ctl, workers, lines = _run(tmp_path, rendezvous, at={STEPS - 2: lambda: box["ctl"].stops.on_signal(signal.SIGTERM)})
    box["ctl"] = ctl
    workers.fail_stop_save = True
    report = ctl.run()
    assert ctl.checkpoints.stop_at == STEPS
    assert ctl.state == State.PREEMPTED and report.status == "preempted", report.error
    assert "SIGTERM: all ranks finished but the final checkpoint" in report.error
    assert ctl.catalog.committed_steps()[-1] < STEPS


def test_the_stop_step_counts_the_steps_trained_while_the_controller_was_busy(tmp_path, rendezvous):
    """A signal comes in with a poll whose drain then takes 0.3 s more (a commit, its retention):
    the ranks train 30 steps meanwhile. The stop step is estimated from the time since the newest
    step record came in, so every rank reads it before it gets there and the stop commits."""
    spec = _spec(tmp_path, train={"steps": 400, "global_batch": 4, "micro_batch": 1})
    workers = WallClockRanks(rendezvous, Storage(spec.checkpoint_root))
    ctl = _controller(spec, workers, rendezvous, [])
    drain = ctl.intake.drain

    def busy_drain(store):
        committed = drain(store)
        if ctl.record.completed_steps() >= 23 and not ctl.stops.signals:
            ctl.stops.on_signal(signal.SIGTERM)
            time.sleep(0.3)  # the rest of this poll's drain
        return committed

    ctl.intake.drain = busy_drain
    report = ctl.run()
    assert report.status == "preempted" and workers.late == [], (report.error, workers.late)
    stop = ctl.checkpoints.stop_at
    assert stop >= 23 + 0.3 / STEP_S and ctl.catalog.committed_steps()[-1] == stop == report.final_step


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_sigint_stops_at_once_and_a_repeated_sigterm_is_the_same_request(tmp_path, rendezvous, second):
    # A pod's stoppers each send a SIGTERM (KubeRay's job stop, then the head's preStop hook, stop-jobs):
    # the stop still commits; Ctrl-C again is the way out at once, leaving the last commit.
    box = {}
    ctl, workers, lines = _run(tmp_path, rendezvous, at={23: lambda: box["ctl"].stops.on_signal(signal.SIGTERM)})
    box["ctl"] = ctl
    while ctl.state != State.STOPPING:
        ctl.step_once()
    ctl.stops.on_signal(second)
    if second == signal.SIGINT:
        assert ctl.step_once() == State.PREEMPTED
        assert ctl.catalog.committed_steps()[-1] == 20 and "SIGINT during the grace" in ctl.error
        assert "last committed checkpoint (step 20) intact" in ctl.error
        return
    report = ctl.run()
    assert report.status == "preempted" and ctl.stops.signals == ["SIGTERM", "SIGTERM"]
    assert ctl.catalog.committed_steps()[-1] == ctl.checkpoints.stop_at == report.final_step > 20


def test_a_signal_outside_training_stops_at_once(tmp_path, rendezvous):
    ctl, workers, lines = _run(tmp_path, rendezvous)
    ctl.stops.on_signal(signal.SIGTERM)
    report = ctl.run()
    assert report.status == "preempted" and "SIGTERM in PLACING" in report.error
    assert workers.actors == {} and ctl.catalog.committed_steps() == []


class SlowRestore(SignallingWorkers):
    """A restore that takes minutes, waiting as the real group does (cluster.interruptible: in slices
    that ask `interrupted()`); 0.3 s into it, a SIGTERM arrives."""

    def restore_all(self, step, dp, timeout_s, faults=None):
        threading.Timer(0.3, lambda: self.stops.on_signal(signal.SIGTERM)).start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.interrupted():
                raise Interrupted("the job is ending")
            time.sleep(0.05)
        return super().restore_all(step, dp, timeout_s, faults)


def test_a_signal_during_a_long_restore_ends_the_job_at_once(tmp_path, rendezvous):
    ctl, workers, lines = _run(tmp_path, rendezvous)
    workers.__class__ = SlowRestore
    workers.stops = ctl.stops
    started = time.monotonic()
    report = ctl.run()
    assert time.monotonic() - started < 10  # not the 300 s restore: the wait gave up at the signal
    assert report.status == "preempted" and "SIGTERM in RESTORING" in report.error, report.error


def test_no_commit_within_the_grace_stops_anyway(tmp_path, rendezvous):
    spec = _spec(tmp_path, train={"steps": STEPS, "global_batch": 4, "micro_batch": 1},
                 elastic={"max_restarts": 1, "preemption_grace_s": 0.3})
    box = {}
    ctl, workers, lines = _run(tmp_path, rendezvous, spec, at={23: lambda: box["ctl"].stops.on_signal(signal.SIGTERM)})
    box["ctl"] = ctl
    workers.fail_stop_save = True  # the stop step's save cannot commit
    started = time.monotonic()
    report = ctl.run()
    assert report.status == "preempted" and time.monotonic() - started < 5.0
    assert f"no commit of step {ctl.checkpoints.stop_at} within elastic.preemption_grace_s=0.3 s" in report.error
    assert "last committed checkpoint (step 30) intact" in report.error  # the save on the way to the stop
    assert ctl.catalog.committed_steps()[-1] == 30


def _drain_run(tmp_path, rendezvous, deadline_in_s: float | None, elastic: dict | None = None,
               hang_min_s: float = 10.0, setup=lambda workers, ctl: None, timeout_s: float = 30.0,
               ranks_drained: bool = True, others: tuple[str, ...] = ()):
    """dp=2, rank 1 on node n2, one warm spare; Ray starts draining n2 (if `ranks_drained`) and the
    `others` once step 15 is reached. `setup(workers, ctl)` before the run; a run that does not
    end within `timeout_s` fails the test."""
    spec = _spec(tmp_path, train={"steps": 60, "global_batch": 4, "micro_batch": 1},
                 elastic={"spares": 1, "max_restarts": 1, **(elastic or {})})
    lines: list[str] = []
    workers = SignallingWorkers(rendezvous, Storage(spec.checkpoint_root), nodes={1: "n2"})
    deadline = None if deadline_in_s is None else time.time() + deadline_in_s

    def drains():
        draining = {"n2": deadline} if ranks_drained else {}
        return {**draining, **dict.fromkeys(others)} if workers.next_step >= 15 else {}

    ctl = Controller(spec, workers, rendezvous, Catalog(Storage(spec.checkpoint_root)), JobMetrics(spec.name),
                     printer=lines.append, poll_s=0.001, release_timeout_s=0.5, drains=drains, hang_min_s=hang_min_s,
                     commit_lane=False)
    setup(workers, ctl)
    box: dict = {}
    runner = threading.Thread(target=lambda: box.update(report=ctl.run()), daemon=True)
    runner.start()
    runner.join(timeout_s)
    assert "report" in box, f"still {ctl.state.value} after {timeout_s} s:\n" + "\n".join(lines)
    return box["report"], workers, lines


def test_a_drained_node_s_ranks_move_to_a_spare_with_no_work_lost(tmp_path, rendezvous):
    report, workers, lines = _drain_run(tmp_path, rendezvous, deadline_in_s=None)
    # The drain is seen at the save of step 20, when the fake reports back.
    stop = int(next(re.search(r"no deadline\): every rank saves step (\d+)", line) for line in lines
                    if "every rank saves step" in line)[1])
    assert stop >= 20 + stop_lead(0.01)
    assert report.status == "succeeded" and report.final_step == 60, report.error
    assert workers.forgotten == ["n2"] and report.failures == []
    assert any(f"STOPPING -> RENDEZVOUS: generation 0 -> 1: node n2 draining (rank(s) [1], no deadline); "
               f"its rank(s) moved at checkpoint step {stop}, no work lost" in line for line in lines)
    assert any("taken over by warm spares" in line for line in lines)
    assert any(f"restored step {stop}" in line for line in lines)
    badput = report.goodput.badput_s
    assert badput.get("lost_work", 0.0) == 0.0 and badput.get("reformation", 0.0) > 0.0
    assert [p.step for p in report.losses] == list(range(60))  # every step trained once


def test_the_wait_for_a_drained_node_s_replacements_is_booked_as_reformation(tmp_path, rendezvous):
    booked_to: list[str] = []

    def slow_takeover(workers, ctl):
        promote = workers.promote_spares

        def promote_slowly(ranks):  # the replacement takes 0.5 s, after the stop step's commit
            booked_to.append(ctl.ledger.current)
            time.sleep(0.5)
            return promote(ranks)

        workers.promote_spares = promote_slowly

    report, _, _ = _drain_run(tmp_path, rendezvous, deadline_in_s=None, setup=slow_takeover)
    assert report.status == "succeeded", report.error
    assert booked_to == ["reformation"]
    assert report.goodput.badput_s["reformation"] >= 0.5


def test_a_drained_node_s_ranks_with_no_seat_elsewhere_shrink_dp_at_the_stop_without_waiting(tmp_path, rendezvous):
    """No spare and no free seat: Ray starts no actor on a draining node, so rather than wait
    elastic.replace_timeout_s (60 s) for a seat there, the job goes on smaller at once."""
    report, workers, lines = _drain_run(tmp_path, rendezvous, deadline_in_s=None, elastic={"spares": 0, "min_dp": 1})
    assert report.status == "succeeded" and report.final_step == 60, report.error
    assert workers.dp_history[:2] == [2, 1] and 1 not in workers.created[2:], workers.created
    assert any("rank(s) [1] not replaced: their seats are on a draining node" in line
               and "shrinking dp 2 -> 1" in line for line in lines), lines
    assert report.failures == []
    # The drain's stop loses nothing (every rank stopped at a committed step); a grow back after it throws
    # away the step in flight at its stop: a few milliseconds of this fake's.
    grew = any("growing dp 1 -> 2" in line for line in lines)
    assert report.goodput.badput_s.get("lost_work", 0.0) < (0.1 if grew else 1e-9), lines


def test_a_drain_shorter_than_a_checkpointed_stop_is_a_node_loss(tmp_path, rendezvous):
    report, workers, lines = _drain_run(tmp_path, rendezvous, deadline_in_s=0.01)
    assert report.status == "succeeded" and report.final_step == 60, report.error
    assert any("node n2 draining, deadline in" in line and "handling it as a node loss" in line for line in lines)
    [failure] = report.failures
    assert failure.kind == "node_lost" and workers.forgotten == ["n2"]


def test_a_drain_whose_stop_cannot_commit_is_a_node_loss_once_every_rank_stopped(tmp_path, rendezvous):
    """No deadline, and the stop step's save fails: every rank returns, no commit can come, and the
    node is handled as lost at once (not never, as an unbounded stop would)."""
    started = time.monotonic()
    report, workers, lines = _drain_run(tmp_path, rendezvous, None,
                                        setup=lambda workers, ctl: setattr(workers, "fail_stop_save", True))
    assert report.status == "succeeded" and report.final_step == 60, report.error
    assert any("every rank stopped but step" in line and "handling it as a node loss" in line for line in lines)
    [failure] = report.failures
    assert failure.kind == "node_lost" and workers.forgotten == ["n2"] and time.monotonic() - started < 10.0


class LateNodeLoss(SignallingWorkers):
    """Node n2 (rank 1's) is reported lost while the release of another failure waits for the ranks."""

    reported = False

    def wait_any(self, timeout_s):
        store = self.rendezvous.generation(self.gen)
        if not self.reported and self.gen == 0 and store.abort_requested():
            self.reported = True
            store.send(NodeLost(node="n2", rank=1, time=time.time()))
        return super().wait_any(timeout_s)


def test_a_node_lost_during_a_release_is_dropped_by_that_recovery_not_the_next_generation(tmp_path, rendezvous):
    spec = _spec(tmp_path, train={"steps": 30, "global_batch": 4, "micro_batch": 1},
                 elastic={"max_restarts": 3, "spares": 0})
    workers = LateNodeLoss(rendezvous, Storage(spec.checkpoint_root), die_at={15: 0}, nodes={1: "n2"})
    lines: list[str] = []
    report = _controller(spec, workers, rendezvous, lines).run()
    assert workers.reported and report.status == "succeeded", report.error
    assert workers.forgotten == ["n2"]
    assert [f.kind for f in report.failures] == ["rank_died"]  # no second recovery of a healthy generation


def test_ranks_hung_before_a_drain_s_stop_step_are_a_hang(tmp_path, rendezvous):
    """No deadline, and the ranks hang before the stop step: the progress watchdog still runs."""
    report, workers, lines = _drain_run(tmp_path, rendezvous, None, hang_min_s=0.5,
                                        setup=lambda workers, ctl: setattr(workers, "stall_at_stop", True))
    assert report.status == "succeeded" and report.final_step == 60, report.error
    assert [f.kind for f in report.failures] == ["hang"]
    assert any("STOPPING -> RECOVERING" in line and "no step for" in line for line in lines)


def test_a_signal_during_a_drain_s_stop_ends_the_job_within_the_grace(tmp_path, rendezvous):
    def setup(workers, ctl):
        workers.stall_at_stop = True  # the stop is never committed: only the grace can end it
        workers.on_stall = lambda: ctl.stops.on_signal(signal.SIGTERM)

    started = time.monotonic()
    report, workers, lines = _drain_run(tmp_path, rendezvous, None, elastic={"preemption_grace_s": 0.3}, setup=setup)
    assert report.status == "preempted" and time.monotonic() - started < 5.0, report.error
    assert "SIGTERM during the drain: no commit of step" in report.error
    assert "within elastic.preemption_grace_s=0.3 s" in report.error


def test_a_draining_node_without_ranks_drops_the_job_s_spares_there_only(tmp_path, rendezvous):
    """Ray drains n3 (nothing of the job's) and n4 (the job's warm spare): n3 is left alone."""
    report, workers, lines = _drain_run(tmp_path, rendezvous, None, ranks_drained=False, others=("n3", "n4"),
                                        setup=lambda workers, ctl: workers.spare_nodes.add("n4"))
    assert report.status == "succeeded" and report.failures == [], report.error
    assert workers.forgotten == ["n4"]
    assert [line.split("] ")[1] for line in lines if "draining" in line] == [
        "node n4 draining: its 1 spare(s) dropped, no rank there"]


def test_a_drained_node_s_rank_never_moves_onto_a_spare_on_another_draining_node(tmp_path, rendezvous):
    """n2 (rank 1) and n4 (the warm spare) drain at once: rank 1 must not be promoted onto n4, where
    it would have to move again (and, with too short a deadline there, be lost)."""
    report, workers, lines = _drain_run(tmp_path, rendezvous, None, others=("n4",),
                                        setup=lambda workers, ctl: workers.spare_nodes.add("n4"))
    assert report.status == "succeeded" and report.final_step == 60, report.error
    assert not any("taken over by warm spares" in line for line in lines), "\n".join(lines)
    assert any("n4" in line and "dropped" in line for line in lines)


def test_a_validation_holds_the_ranks_at_its_step_in_the_estimate():
    """The time since the newest step record counts steps, except while the ranks validate
    (eval.every_steps=30): the estimate stops at a validation step not reported done."""
    from trainer.config import EvalConfig

    def stops(evaluation, done=()):
        record = SimpleNamespace(evals=[SimpleNamespace(step=step) for step in done])
        spec = SimpleNamespace(eval=evaluation, train=SimpleNamespace(steps=100))
        return Stops(spec, None, None, record, None, None, None, dict, print)

    every_30 = EvalConfig(path="file:///held-out", every_steps=30)
    assert stops(every_30)._validating(28, 90) == 30
    assert stops(every_30)._validating(30, 90) == 30  # validating after step 30
    assert stops(every_30, done=[30])._validating(28, 90) == 60
    assert stops(every_30, done=[30])._validating(31, 40) == 40
    assert stops(None)._validating(28, 90) == 90


def test_the_wait_for_a_generations_last_receipts_starts_at_its_own_return():
    """A drain's stop left its look at the returned ranks behind (a recovery followed): the job's last
    generation still waits its own RECEIPTS_S for the final save's receipts, not none."""
    from orchestrator.controller.states import TrainingRun

    now = [0.0]
    checkpoints = SimpleNamespace(committer=SimpleNamespace(committing={}))
    stops = Stops(None, None, checkpoints, None, None, None, None, dict, print, clock=lambda: now[0])
    drained, last = TrainingRun(), TrainingRun()
    assert stops._receipts_may_come(drained)
    now[0] = 100.0
    assert not stops._receipts_may_come(drained)
    assert stops._receipts_may_come(last)  # its own wait begins now
    now[0] = 100.0 + RECEIPTS_S
    assert not stops._receipts_may_come(last)


def test_a_signal_while_a_drain_re_forms_ends_the_job_at_the_committed_stop(tmp_path, rendezvous):
    """The stop step is committed and the generation stops to re-form without the drained node; its
    ranks are slow to leave. One SIGTERM meanwhile must end the job there within the grace, not wait
    the re-formation out (its waits can take minutes: leaving, warming spares, new actors)."""
    def setup(workers, ctl):
        def slow_to_leave(ranks, timeout_s):
            ctl.stops.on_signal(signal.SIGTERM)
            if workers.interrupted():  # as the real worker group's sliced waits ask
                raise Interrupted("the job is ending")
            raise AssertionError("the wait went on past the signal")

        workers.leave_all = slow_to_leave

    report, workers, lines = _drain_run(tmp_path, rendezvous, None, setup=setup)
    assert report.status == "preempted", report.error
    assert "SIGTERM while the job re-formed after a commit" in report.error
    assert "last committed checkpoint (step" in report.error and "intact" in report.error


@pytest.mark.parametrize("victim", [0, 1])  # rank 1 sits on the drained node n2, which is going anyway
def test_a_rank_that_dies_as_a_drain_s_generation_stops_is_a_failure_counted_and_replaced(tmp_path, rendezvous,
                                                                                          victim):
    def dies_leaving(workers, ctl):
        leave_all = workers.leave_all

        def leave(ranks, timeout_s):  # the drain's stop: the victim dies as it leaves the generation
            if workers.gen == 0 and victim in workers.actors and ctl.state == State.STOPPING:
                workers.actors.pop(victim)
            return leave_all([r for r in ranks if r in workers.actors], timeout_s)
        workers.leave_all = leave

    report, workers, lines = _drain_run(tmp_path, rendezvous, deadline_in_s=None, setup=dies_leaving,
                                        elastic={"max_restarts": 2, "spares": 2})
    assert report.status == "succeeded" and report.final_step == 60, report.error
    assert [p.step for p in report.losses] == list(range(60))  # every step trained once: nothing lost
    if victim == 1:  # the drained node's own rank: moved off as planned, no failure
        assert report.failures == [] and any("no work lost" in line for line in lines), "\n".join(lines)
        return
    [failure] = report.failures
    assert (failure.kind, failure.rank, failure.lost_work_s) == ("rank_died", 0, 0.0)
    assert any("STOPPING -> RECOVERING: generation 0: rank_died on rank 0" in line and "moving off node n2" in line
               for line in lines), "\n".join(lines)
