"""Growing back and shrinking, driven by the controller with test_controller's fake worker group: dp
shrinks when no replacement comes and grows back at a commit onto warm spares, by whole TP groups;
a rank lost while the generation stops to grow, or a spare lost before its promotion, is handled."""

from __future__ import annotations

import time

from ckpt.storage import Storage
from orchestrator.cluster.placement import SpareChoice
from orchestrator.cluster.worker_group import RankOutcome
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec
from tests.unit.test_controller import rendezvous as rendezvous  # noqa: F401  (the fixture)


class RecordsTheBucketOfGrowth(FakeWorkerGroup):
    """Records the goodput bucket the controller books to when it grows the group."""

    ctl = None

    def grow(self, world_size):
        self.grown_while = [*getattr(self, "grown_while", []), self.ctl.ledger.current]
        return super().grow(world_size)


def _shrink_then_grow(tmp_path, rendezvous, group_class):
    """Rank 1 dies at step 15 with no replacement (dp shrinks), a spare comes back for the commit of
    step 20 (dp grows): (report, workers, printed lines)."""
    spec = _spec(tmp_path)
    workers = group_class(rendezvous, Storage(spec.checkpoint_root), die_at={15: 1}, cold_start_works=False)
    lines: list[str] = []
    workers.ctl = _controller(spec, workers, rendezvous, lines)
    return workers.ctl.run(), workers, lines


def test_without_replacement_dp_shrinks_then_grows_back(tmp_path, rendezvous):
    report, workers, lines = _shrink_then_grow(tmp_path, rendezvous, RecordsTheBucketOfGrowth)
    assert report.status == "succeeded" and report.final_step == 30
    assert workers.dp_history == [2, 1, 2]  # shrink at the failure, grow at the next commit
    assert [(w.generation, w.dp) for w in report.world_history] == [(0, 2), (1, 1), (2, 2)]
    assert any("shrinking dp 2 -> 1" in line for line in lines)
    assert any("growing dp 1 -> 2 at checkpoint step 20" in line for line in lines)
    assert len(report.failures) == 1  # growing is not a failure
    assert workers.grown_while == ["reformation"]  # the grow's stop and re-formation train nothing


class LosesTheSpareItCounted(RecordsTheBucketOfGrowth):
    """The spare the first grow counted on dies before its promotion (it promotes nobody)."""

    def grow(self, world_size):
        if not getattr(self, "lost_one", False):
            self.lost_one = True
            self.spares.pop()
            return []
        return super().grow(world_size)


def test_a_grow_whose_spare_died_before_its_promotion_forms_the_dp_it_holds(tmp_path, rendezvous):
    report, _, lines = _shrink_then_grow(tmp_path, rendezvous, LosesTheSpareItCounted)
    assert report.status == "succeeded" and report.final_step == 30, report.error
    assert any("growing dp 1 -> 1 at checkpoint step 20" in line and "a spare died before its promotion: dp 1, "
               "not 2" in line for line in lines), "\n".join(lines)
    assert len(report.failures) == 1  # no failed generation of more ranks than actors


class DiesWhileStoppingToGrow(FakeWorkerGroup):
    """Rank 0 of the shrunken generation dies while that generation stops to grow back."""

    def wait_any(self, timeout_s):
        if self.gen == 1 and self._running and self.gen_store.abort_requested() and 0 in self.actors:
            self.actors.pop(0)
            self._running.discard(0)
            return [RankOutcome(0, "died", {"error": "The actor died unexpectedly"})]
        return super().wait_any(timeout_s)

    def promote_spares(self, ranks):  # the spares the grow counted on are warm: one takes the hole
        seats, left = {}, []
        for r in ranks:
            if self.spares:
                self.actors[r] = self.spares.pop()
                seats[r] = len(self.spares)
            else:
                left.append(r)
        return SpareChoice(seats, [], left)


def test_a_rank_lost_while_stopping_to_grow_is_a_failure_replaced_first_and_the_grow_waits(tmp_path, rendezvous):
    spec = _spec(tmp_path, elastic={"max_restarts": 2})
    workers = DiesWhileStoppingToGrow(rendezvous, Storage(spec.checkpoint_root), die_at={15: 1},
                                      cold_start_works=False)
    lines: list[str] = []
    report = _controller(spec, workers, rendezvous, lines).run()
    assert report.status == "succeeded" and report.final_step == 30, report.error
    lost = "lost as the generation stopped at checkpoint step 20 (growing)"
    assert any("RUNNING -> RECOVERING: generation 1: rank_died on rank 0" in line and lost in line for line in lines)
    assert [(f.kind, f.rank) for f in report.failures] == [("rank_died", 1), ("rank_died", 0)]  # booked
    assert report.failures[1].lost_work_s == 0.0  # nothing was trained past the commit
    assert report.redone_steps == 6  # 10-15 after the death in step 15; none after the stop at 20 (none in flight)
    assert workers.dp_history == [2, 1, 1]  # the hole filled at dp 1, not a grow with rank 0 missing
    # It counts against elastic.max_restarts as any failure: a rank dying at every grow ends the job.
    tight = _spec(tmp_path, name="unit2")  # elastic.max_restarts 1
    again = DiesWhileStoppingToGrow(rendezvous, Storage(tight.checkpoint_root), die_at={15: 1}, cold_start_works=False)
    spent = _controller(tight, again, rendezvous, []).run()
    assert spent.status == "failed" and "rank_died on rank 0: 1 restarts used" in spent.error


class KilledByAFaultWhileStoppingToGrow(DiesWhileStoppingToGrow):
    """As above, the death an injected fault's, whose notice the rank pushed as it died."""

    def wait_any(self, timeout_s):
        stopping = self.gen == 1 and self._running and self.gen_store.abort_requested() and 0 in self.actors
        outcomes = super().wait_any(timeout_s)
        if stopping:
            self.gen_store.push_event({"type": "fault", "fault_id": 7, "kind": "kill_rank", "rank": 0,
                                       "step": 21, "time": time.time()})
        return outcomes


def test_a_fault_that_fires_while_the_generation_stops_to_grow_is_taken_and_dealt_with(tmp_path, rendezvous):
    """The stopped generation's last events are read: the fault is recorded as fired (not fired again after
    the restore) and dealt with by the re-formation (never blamed for a later failure)."""
    spec = _spec(tmp_path, elastic={"max_restarts": 2})
    workers = KilledByAFaultWhileStoppingToGrow(rendezvous, Storage(spec.checkpoint_root), die_at={15: 1},
                                                cold_start_works=False)
    lines: list[str] = []
    ctl = _controller(spec, workers, rendezvous, lines)
    report = ctl.run()
    assert report.status == "succeeded" and report.final_step == 30, report.error
    assert ctl.fault_clock.fired[7].handled and ctl.fault_clock.take_fired() is None
    assert any("chaos:" in line and "kill_rank" in line for line in lines), "\n".join(lines)


def test_tensor_parallel_job_shrinks_and_grows_by_whole_tp_groups(tmp_path, rendezvous):
    # dp=2 x tp=2: rank 2 (replica 1's first TP rank) dies; the job shrinks to replica 0's
    # TP group (old ranks 0 and 1) and grows back to 4 ranks, never to a partial TP group.
    spec = _spec(tmp_path, parallel={"dp": 2, "tp": 2})
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root), die_at={15: 2}, cold_start_works=False)
    lines: list[str] = []
    ctl = _controller(spec, workers, rendezvous, lines)
    real_renumber = workers.renumber
    kept: list[list[int]] = []

    def renumber(keep):
        kept.append(list(keep))
        real_renumber(keep)

    workers.renumber = renumber
    report = ctl.run()
    assert report.status == "succeeded", report.error
    assert kept == [[0, 1]]
    assert [(w.dp, w.world_size) for w in report.world_history] == [(2, 4), (1, 2), (2, 4)]


def test_a_grow_waits_for_one_commit_with_a_create_under_way_not_for_ever():
    # A store slower than the save cadence always has a create under way when one lands: the grow is put
    # off once, to the next commit, then goes ahead (its stop waits for that create, bounded).
    from types import SimpleNamespace

    import pytest

    from orchestrator.controller.stopping import Stops

    class Proceeded(Exception):
        pass

    stops = Stops.__new__(Stops)
    stops.grow_put_off = None
    stops.spec = SimpleNamespace(train=SimpleNamespace(steps=60))
    stops.record = SimpleNamespace(completed_steps=lambda: 30)
    stops.recovery = SimpleNamespace(grow_to=lambda dp, world_size: (4, 2))
    stops.checkpoints = SimpleNamespace(committer=SimpleNamespace(committing={30: object()}))
    stops.ledger = SimpleNamespace(enter=lambda bucket: (_ for _ in ()).throw(Proceeded(bucket)))
    assert stops.grow_at(None, 1, 2, 4, since=0.0) is None  # put off: the create under way lands first
    with pytest.raises(Proceeded, match="reformation"):
        stops.grow_at(None, 1, 2, 4, since=0.0)  # the next commit's poll grows


def test_a_grow_books_the_step_in_flight_at_its_stop_as_lost_work(monkeypatch):
    # The generation is stopped mid-step to grow: that step's time until the stop was booked productive
    # and is thrown away with it, as a failure's step in flight is.
    from types import SimpleNamespace

    from orchestrator.controller import stopping
    from orchestrator.controller.stopping import Stops

    monkeypatch.setattr(stopping, "time", SimpleNamespace(time=lambda: 1000.0))
    asked, moved = [], []
    stops = Stops.__new__(Stops)
    stops.grow_put_off = None
    stops.recovery = SimpleNamespace(grow_to=lambda dp, world_size: (4, 2), model_parallel=lambda: 1)
    stops.checkpoints = SimpleNamespace(committer=SimpleNamespace(committing={}), flush=lambda: None, latest=30,
                                        memory=SimpleNamespace(forget_newer=lambda step: None))
    stops.ledger = SimpleNamespace(enter=lambda bucket: None, move=lambda s, src, dst: moved.append((s, src, dst)))
    stops.spec = SimpleNamespace(train=SimpleNamespace(steps=60))
    stops.record = SimpleNamespace(rolled_back_seconds=lambda step, since, failed_at=None: asked.append(
        (step, since, failed_at)) or 7.0, completed_steps=lambda: 31)
    stops.workers = SimpleNamespace(grow=lambda n: None, actors=dict.fromkeys(range(4)))
    stops._stop_generation = lambda store, world_size: ([], None)
    stops.grow_at(None, 1, 2, 2, since=900.0)
    assert asked == [(30, 900.0, 1000.0)] and moved == [(7.0, "productive", "lost_work")]
