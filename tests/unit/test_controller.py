"""The controller state machine, driven one transition at a time with a fake worker group.

The fake stands in for Ray actors: it "trains" by pushing the events real ranks push (step
records from rank 0, shard receipts from every rank) into the real rendezvous store, and can
make a rank die at a chosen step. Storage and the store are real (local dir, TCPStore).
"""

from __future__ import annotations

import time

import pytest
import torch

from chaos.config import as_armed
from ckpt.catalog import Catalog
from ckpt.reader import verify_checkpoint
from ckpt.shards import write_shard
from ckpt.staging import staging_env
from ckpt.storage import Storage
from monitor.metrics import JobMetrics
from orchestrator.cluster.placement import SpareChoice, tp_locality
from orchestrator.cluster.worker_group import PlacementError, RankOutcome, RayWorkerGroup
from orchestrator.controller.fault_clock import FaultClock
from orchestrator.controller.machine import Controller
from orchestrator.controller.states import TERMINAL, TRANSITIONS, State
from orchestrator.spec.job_spec import validate_spec
from orchestrator.wire.messages import CheckpointPlan, FaultFired
from orchestrator.wire.store import PLAN, RendezvousServer


class FakeWorkerGroup:
    blocking_s = 0.001  # each save's blocking time, every rank's (slept through when over 10 ms)

    def __init__(self, rendezvous: RendezvousServer, storage: Storage, die_at: dict | None = None,
                 place_error: str | None = None, cold_start_works: bool = True):
        self.rendezvous = rendezvous
        self.storage = storage
        self.die_at = dict(die_at or {})  # step -> rank that dies there (every time it is reached)
        self.place_error = place_error
        self.cold_start_works = cold_start_works
        self.actors: dict[int, str] = {}
        self.created: list[int] = []
        self.spares: list[str] = []
        self.dp_history: list[int] = []
        self.gen = -1
        self.next_step = 0
        self.cascade = False
        self.repeat = False
        self.slow: set[int] = set()
        self.evicted: list[int] = []
        self._running: set[int] = set()
        self.until = 0
        self.fail_shard: dict[int, int] = {}  # step -> rank whose shard write fails (a save_error event)
        self.verify_restore = False  # restore reads the checkpoint whole, as real ranks do
        self.step_sleep = 0.0  # wall seconds per step: > 0.01 makes productive hold the step_s steps report

    def controller_node(self) -> str:
        return "head"

    def inject(self, rank: int, fault) -> None:
        """A time-triggered fault: the rank reports it, then dies at the next step it reaches."""
        self.gen_store.push_event({"type": "fault", "fault_id": fault.id, "kind": fault.kind, "rank": rank,
                                   "step": self.next_step, "point": "timed", "time": time.time()})
        self.die_at[self.next_step] = rank

    def node_of(self, rank: int) -> str:
        return "head"

    placement_wait_s = 0.0  # what `place` waited for the cluster's capacity (a test sets it)

    def place(self, world_size, spares=0, on_wait=lambda seconds: None):
        time.sleep(self.placement_wait_s)
        on_wait(self.placement_wait_s)  # (booked however the wait ended, as WorkerGroup.place does)
        if self.place_error:
            raise PlacementError(self.place_error)
        self.n_spares = spares
        self.seats = world_size + spares

    def ensure_actors(self, ranks):
        for r in ranks:
            self.actors[r] = f"actor-{r}"
            self.created.append(r)

    def start_spares(self, avoid=frozenset()):
        # A spare in each free seat (the job's seats: its ranks at placement and its spares).
        free = list(range(len(self.spares), self.seats - len(self.actors)))
        self.spares += ["spare"] * len(free)
        return free

    def ready_spares(self):
        return list(range(len(self.spares)))

    def live_ready_spares(self):
        return self.ready_spares()

    def drop_spares_on(self, nodes):
        return 0  # the fake's spares run on no node

    def spare_seats(self):
        return list(range(len(self.spares)))

    def promote_spares(self, ranks):
        seats, left = {}, []
        for r in ranks:
            if self.spares and self.n_spares:
                self.actors[r] = self.spares.pop()
                seats[r] = len(self.spares)
            else:
                left.append(r)
        return SpareChoice(seats, [], left)

    def promotable_spares(self):
        return len(self.live_ready_spares())

    def await_spares(self, seats, count, timeout_s):
        pass  # every spare here is warm as soon as it is started

    def stranded(self, ranks, draining):
        # Every rank's seat is on its node, and no seat is free elsewhere.
        return [r for r in ranks if self.node_of(r) in draining]

    def replace_cold(self, ranks, timeout_s, draining=frozenset()):
        if not self.cold_start_works:
            return list(ranks)
        self.ensure_actors(ranks)
        return []

    def renumber(self, keep):
        self.spares += [self.actors[old] for old in self.actors if old not in keep]  # as WorkerGroup keeps them
        self.actors = {i: self.actors[old] for i, old in enumerate(keep)}

    def grow(self, world_size):
        new = list(range(len(self.actors), world_size))
        for r in new:
            self.actors[r] = self.spares.pop()
        return new

    def ping_all(self, timeout_s):
        return [{} for _ in self.actors]

    def join_all(self, gen, address, timeout_s, collective_timeout_s=None):
        self.gen, self.collective_timeout_s = gen, collective_timeout_s
        return [0.0] * len(self.actors)

    def restore_all(self, step, dp, timeout_s, faults=None):
        if self.verify_restore and step is not None:
            verify_checkpoint(Catalog(self.storage), step)  # CorruptCheckpoint, as from a real rank
        self.dp_history.append(dp)
        self.next_step = step or 0
        self.gen_store = self.rendezvous.generation(self.gen)
        return [{"next_step": self.next_step}] * len(self.actors)

    def start_training(self, until_step, faults, **kwargs):
        self.until, self.eval_at = until_step, kwargs.get("eval_at")
        self._running = set(self.actors)
        self.cascade = False

    def _train(self):
        store = self.rendezvous.generation(self.gen)
        world = len(self.actors)
        while self.next_step < self.until:
            plan = CheckpointPlan.from_json(store.get_json(PLAN))  # read at every step boundary, as ranks do
            step = self.next_step
            if step in self.die_at and self.die_at[step] in self.actors:
                dead = self.die_at[step] if self.repeat else self.die_at.pop(step)
                self.actors.pop(dead)
                self._running.discard(dead)
                self.cascade = True
                return [RankOutcome(dead, "died", {"error": "actor died"})]
            time.sleep(self.step_sleep)
            self.push_step(store, step)
            self.next_step += 1
            if plan.should_save(self.next_step) or plan.stops(self.next_step):
                self.save_shards(store, self.next_step, world)
                if plan.stops(self.next_step):
                    break  # the generation's stop step (preemption, node drain): every rank returns here
                if self.next_step < self.until:
                    return []  # the controller sees each checkpoint before training goes on
        done = [RankOutcome(r, "done", {}) for r in sorted(self._running)]
        self._running.clear()
        return done

    def push_step(self, store, step):
        """Rank 0's step record and every rank's heartbeat for `step`."""
        store.push_event({"type": "step", "step": step, "loss": 10.0 / (step + 1), "tokens": 100,
                          "grad_norm": 1.0, "lr": 1e-3, "step_s": 0.01, "compute_s": 0.01, "time": time.time()})
        for rank in self.actors:  # heartbeats: the rank in `slow` computes 30% longer
            store.set_json(f"hb/{rank}", {"step": step, "time": step, "compute_s": 1.3 if rank in self.slow
                                          else 1.0})

    def save_shards(self, store, step, world):
        """Every rank's shard of completed step `step`, and its receipt (or its save error)."""
        if self.blocking_s > 0.01:
            time.sleep(self.blocking_s)  # the ranks blocked together, booked productive until the receipts
        for rank in range(world):
            if self.fail_shard.get(step) == rank:
                store.push_event({"type": "save_error", "rank": rank, "step": step,
                                  "error": "InjectedStorageError: injected storage_error"})
                continue
            t = {f"w{rank}": torch.full((2,), float(step))}
            receipt = write_shard(self.storage, step, rank, t, blocking_s=self.blocking_s)
            extra = {"engine": {"next_step": step}} if rank == 0 else {}
            store.push_event({"type": "receipt", "receipt": receipt.model_dump(), "extra": extra})

    def wait_any(self, timeout_s):
        if self._running and self.gen_store.abort_requested():  # growing back: everyone stops
            out = [RankOutcome(r, "aborted", {"error": "abort requested"}) for r in sorted(self._running)]
            self._running.clear()
            return out
        if self.cascade:  # survivors of a death leave their collective with an error
            self.cascade = False
            out = [RankOutcome(r, "aborted", {"error": "collective error"}) for r in sorted(self._running)]
            self._running.clear()
            return out
        return self._train() if self._running else []

    def running(self):
        return sorted(self._running)

    def kill(self, rank):
        self.actors.pop(rank, None)

    def kill_actor_only(self, rank):
        self.evicted.append(rank)
        self.slow.discard(rank)  # its replacement runs at normal speed
        self.die_at[self.next_step] = rank

    def leave_all(self, ranks, timeout_s):
        return []

    def nodes_in_use(self):
        return set()  # no Ray node here for the release's probe to ask (tests/unit/test_release_probe.py)

    def shutdown(self):
        self.actors.clear()


def _spec(tmp_path, **over):
    data = {
        "name": "unit", "model": {"preset": "tiny"}, "data": {"seq_len": 16},
        "train": {"steps": 30, "global_batch": 4, "micro_batch": 1},
        "parallel": {"dp": 2}, "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 10, "keep": 2},
        "elastic": {"max_restarts": 1},
    }
    data.update(over)
    # The fake group keeps no memory level (it sends no snapshot receipts): a failure rolls back to
    # the newest storage checkpoint, unless a test switches the level on itself.
    data["checkpoint"] = {"memory": {"enabled": False}, **data["checkpoint"]}
    return validate_spec(data)


@pytest.fixture
def rendezvous():
    return RendezvousServer("127.0.0.1")


def _controller(spec, workers, rendezvous, lines):
    # Manifest creates inline: the fake ranks step in a millisecond, so a create on the commit lane
    # would land many steps late, and these tests pin the steps commits (and grows) happen at.
    catalog = Catalog(Storage(spec.checkpoint_root))
    return Controller(spec, workers, rendezvous, catalog, JobMetrics(spec.name), printer=lines.append,
                      poll_s=0.001, release_timeout_s=0.5, commit_lane=False)


def test_one_transition_at_a_time_to_success(tmp_path, rendezvous):
    spec = _spec(tmp_path)
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    lines: list[str] = []
    ctl = _controller(spec, workers, rendezvous, lines)
    assert ctl.state == State.PLACING
    assert ctl.step_once() == State.RENDEZVOUS and sorted(workers.actors) == [0, 1]
    assert ctl.step_once() == State.RESTORING and ctl.gen == 0
    assert ctl.step_once() == State.RUNNING and ctl.restored_step is None
    seen = [State.RUNNING]
    while ctl.state not in TERMINAL:
        seen.append(ctl.step_once())
    # The fake's receipts of a save all arrive in one drain: CHECKPOINTING is passed through within
    # a poll, and every commit is still logged.
    assert seen == [State.RUNNING, State.SUCCEEDED]
    for step in (10, 20, 30):
        assert sum(f"CHECKPOINTING -> RUNNING: step {step} committed: " in line for line in lines) == 1, lines
    assert ctl.checkpoints.latest == 30
    ctl.checkpoints.close()  # as run() does at the end: retention runs on its own thread
    assert ctl.catalog.committed_steps() == [20, 30]  # keep=2
    assert any("RUNNING -> SUCCEEDED" in line for line in lines)


def test_dead_rank_is_replaced_and_job_resumes_from_last_commit(tmp_path, rendezvous):
    spec = _spec(tmp_path)
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root), die_at={25: 1})
    lines: list[str] = []
    report = _controller(spec, workers, rendezvous, lines).run()
    assert report.status == "succeeded" and report.final_step == 30
    assert workers.created == [0, 1, 1]  # only the dead rank got a new actor
    [failure] = report.failures
    assert failure.kind == "rank_died" and failure.rank == 1 and failure.recovered_after_s is not None
    assert [w.generation for w in report.world_history] == [0, 1]
    assert any("restored step 20" in line for line in lines)
    assert [p.step for p in report.losses] == list(range(30))
    totals = report.goodput  # against the ledger's clock (its wall_s is the buckets' own sum)
    assert abs(totals.productive_s + sum(totals.badput_s.values()) - totals.clock_wall_s) < 1e-6
    # Once generation 1 trained, the store forgot generation 0: only the last generation's keys stay.
    from orchestrator.wire.auth import key_prefix

    keys = rendezvous._server.list_keys()
    assert keys and all(k.startswith(key_prefix(rendezvous._secret, 1) + "/") for k in keys), keys


def test_restart_budget_exhausted_fails_with_checkpoints_intact(tmp_path, rendezvous):
    spec = _spec(tmp_path)
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root), die_at={12: 0, 25: 1})
    report = _controller(spec, workers, rendezvous, []).run()
    assert report.status == "failed" and "max_restarts=1" in report.error
    assert report.final_step == 20
    assert Catalog(Storage(spec.checkpoint_root)).committed_steps() == [10, 20]


def test_placement_error_fails_fast(tmp_path, rendezvous):
    spec = _spec(tmp_path)
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root), place_error="cluster has 1 CPU")
    ctl = _controller(spec, workers, rendezvous, [])
    report = ctl.run()
    assert ctl.state == State.FAILED and report.status == "failed" and "1 CPU" in report.error


def test_finished_job_is_not_run_again(tmp_path, rendezvous):
    spec = _spec(tmp_path)
    _controller(spec, FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root)), rendezvous, []).run()
    lines: list[str] = []
    workers = FakeWorkerGroup(RendezvousServer("127.0.0.1"), Storage(spec.checkpoint_root))
    report = _controller(spec, workers, workers.rendezvous, lines).run()
    assert report.status == "succeeded" and report.final_step == 30 and report.losses == []
    assert any("already finished" in line for line in lines)


def test_a_validation_owed_at_the_restored_step_is_run_first_even_when_the_job_had_finished(tmp_path, rendezvous):
    """A generation that ended during (or at a save before) the validation of the step it saved, the job's
    last included, owes it: the ranks run it before their first step, and the job ends only after it."""
    spec = _spec(tmp_path, eval={"path": f"file://{tmp_path}/heldout", "every_steps": 10})
    _controller(spec, FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root)), rendezvous, []).run()
    lines: list[str] = []
    workers = FakeWorkerGroup(RendezvousServer("127.0.0.1"), Storage(spec.checkpoint_root))
    report = _controller(spec, workers, workers.rendezvous, lines).run()  # the fake reports no validation
    assert report.status == "succeeded" and report.final_step == 30 and workers.eval_at == 30
    assert not any("already finished" in line for line in lines)
    from orchestrator.wire.messages import EvalDone

    ctl = _controller(spec, FakeWorkerGroup(RendezvousServer("127.0.0.1"), Storage(spec.checkpoint_root)),
                      rendezvous, [])
    assert ctl.record.eval_owed(20, spec.eval, 30) == 20 and ctl.record.eval_owed(25, spec.eval, 30) is None
    ctl.record.on_eval(EvalDone(step=20, loss=2.0, tokens=64, seconds=0.1))
    assert ctl.record.eval_owed(20, spec.eval, 30) is None and ctl.record.eval_owed(None, spec.eval, 30) is None


class FlushesItsLastSaveSlowly(FakeWorkerGroup):
    """Every rank returns FLUSH_S after the final checkpoint's step and receipts reached the controller."""

    FLUSH_S = 0.5
    held = flushed = None

    def wait_any(self, timeout_s):
        if self.held is not None:
            time.sleep(self.FLUSH_S)  # the ranks wait for their last shard to be durable
            out, self.held = self.held, None
            return out
        out = super().wait_any(timeout_s)
        if out and all(o.status == "done" for o in out) and not self.flushed:
            self.held, self.flushed = out, True
            return []
        return out


def test_the_ranks_wait_for_their_last_save_is_booked_as_checkpoint_save(tmp_path, rendezvous):
    spec = _spec(tmp_path)
    workers = FlushesItsLastSaveSlowly(rendezvous, Storage(spec.checkpoint_root))
    report = _controller(spec, workers, rendezvous, []).run()
    assert report.status == "succeeded", report.error
    saving = report.goodput.badput_s["checkpoint_save"]
    assert workers.FLUSH_S <= saving < workers.FLUSH_S + 0.4, report.goodput
    assert report.goodput.productive_s < report.goodput.wall_s - workers.FLUSH_S


class FallsSilentAfterStep10(FakeWorkerGroup):
    """Generation 0's ranks stop after the save of step 10: no step, no outcome, until aborted."""

    def wait_any(self, timeout_s):
        if self.gen == 0 and self.next_step == 10 and self._running and not self.gen_store.abort_requested():
            time.sleep(timeout_s)
            return []
        return super().wait_any(timeout_s)


def test_a_hang_no_fault_explains_books_its_wait_to_be_declared_as_detection(tmp_path, rendezvous):
    spec = _spec(tmp_path, elastic={"max_restarts": 1, "hang_timeout_s": 1.0})
    workers = FallsSilentAfterStep10(rendezvous, Storage(spec.checkpoint_root))
    ctl = Controller(spec, workers, rendezvous, Catalog(Storage(spec.checkpoint_root)), JobMetrics(spec.name),
                     printer=lambda _: None, poll_s=0.01, release_timeout_s=0.5, hang_min_s=1.0,
                     commit_lane=False)
    report = ctl.run()
    assert report.status == "succeeded" and [f.kind for f in report.failures] == ["hang"], report.error
    # Silent for the 1 s limit after step 9's record; a usual step (10 ms here) of it was the step's own.
    assert 0.9 <= report.goodput.badput_s["detection"] < 2.0, report.goodput


def test_warm_spare_takes_over(tmp_path, rendezvous):
    spec = _spec(tmp_path, elastic={"spares": 1, "max_restarts": 2})
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root), die_at={12: 0})
    lines: list[str] = []
    report = _controller(spec, workers, rendezvous, lines).run()
    assert report.status == "succeeded"
    assert workers.created == [0, 1]  # no cold actor: the spare took rank 0
    assert any("taken over by warm spares" in line for line in lines)


def test_crash_loop_stops_with_step_rank_and_error(tmp_path, rendezvous):
    spec = _spec(tmp_path, elastic={"max_restarts": 10})
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root), die_at={25: 1})
    workers.repeat = True
    report = _controller(spec, workers, rendezvous, []).run()
    assert report.status == "failed"
    assert "crash loop: rank 1 failed at step 25 3 times" in report.error and "actor died" in report.error
    assert len(report.failures) == 3


def _straggling(tmp_path, rendezvous, spares: int):
    """A 60-step job whose rank 1 computes 1.3x its peers', evict_stragglers on, with `spares` warm spares."""
    spec = _spec(tmp_path, train={"steps": 60, "global_batch": 4, "micro_batch": 1},
                 elastic={"evict_stragglers": True, "max_restarts": 2, "spares": spares},
                 monitor={"heartbeat_s": 0.001})
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    workers.slow = {1}
    lines: list[str] = []
    ctl = _controller(spec, workers, rendezvous, lines)
    ctl.telemetry.detector.sustain_s = 0.0  # the fake trains in milliseconds
    return ctl.run(), workers, lines


def test_sustained_straggler_is_flagged_and_evicted(tmp_path, rendezvous):
    report, workers, lines = _straggling(tmp_path, rendezvous, spares=1)
    assert report.status == "succeeded" and workers.evicted == [1]
    assert [s.rank for s in report.stragglers] == [1] and report.stragglers[0].ratio == pytest.approx(1.3)
    assert [(f.kind, f.rank) for f in report.failures] == [("straggler_evicted", 1)]
    assert any("straggler: rank 1 computes 1.30x" in line and "evicting" in line for line in lines)


def test_a_straggler_with_no_warm_spare_to_take_it_over_is_flagged_not_evicted(tmp_path, rendezvous):
    # A new actor would start in its own seat, on the same slow device, and be evicted again and
    # again until the restart budget ran out: without a warm spare it stays, said so.
    report, workers, lines = _straggling(tmp_path, rendezvous, spares=0)
    assert report.status == "succeeded" and workers.evicted == [] and report.failures == []
    assert [s.rank for s in report.stragglers] == [1]
    assert any("straggler: rank 1" in line and "not evicted: no warm spare" in line for line in lines)


def test_kill_node_on_the_controllers_own_node_is_refused(tmp_path, rendezvous):
    spec = _spec(tmp_path, chaos={"faults": [{"kind": "kill_node", "rank": 1, "at_step": 5}]})
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    report = _controller(spec, workers, rendezvous, []).run()
    assert report.status == "failed"
    assert "kill_node on rank(s) [1] would kill the node the controller runs on" in report.error


def test_time_triggered_fault_is_fired_by_the_controller(tmp_path, rendezvous):
    spec = _spec(tmp_path, chaos={"faults": [{"kind": "kill_rank", "rank": 1, "at_seconds": 0}]})
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    lines: list[str] = []
    report = _controller(spec, workers, rendezvous, lines).run()
    assert report.status == "succeeded", report.error
    [failure] = report.failures
    assert failure.kind == "kill_rank" and failure.rank == 1 and failure.detected_after_s is not None


def test_measured_save_cost_sets_the_young_cadence_after_the_first_commit(tmp_path, rendezvous):
    # The fake's saves block 1 ms and its steps take 10 ms: tau = sqrt(2 * 0.001 * 36) s = 0.27 s,
    # i.e. 27 steps, instead of the 10-step probe the first plan uses.
    spec = _spec(tmp_path, train={"steps": 60, "global_batch": 4, "micro_batch": 1},
                 checkpoint={"url": f"file://{tmp_path}/ckpt", "interval": "young", "mtbf_s": 36.0})
    lines: list[str] = []
    report = _controller(spec, FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root)), rendezvous, lines).run()
    assert report.status == "succeeded", report.error
    assert any("checkpoint cadence: every 27 steps" in line for line in lines), lines
    assert [c.step for c in report.checkpoints][:2] == [10, 40]  # the probe, then 27 steps from the anchor


def test_placement_says_whether_tp_groups_share_a_node(tmp_path, rendezvous):
    spec = _spec(tmp_path, parallel={"dp": 2, "tp": 2}, train={"steps": 10, "global_batch": 4, "micro_batch": 1})
    lines: list[str] = []
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    ctl = _controller(spec, workers, rendezvous, lines)
    ctl._placing()
    assert "each TP group on one node, 2 TP group(s) over 1 node(s) (pack)" in lines[-1]
    # ranks 0 and 1 (a TP group) on two nodes
    assert "TP group(s) [[0, 1], [2, 3]] span nodes" in tp_locality(spec, 4, lambda rank: f"node{rank % 2}")
    # spread: one group per node
    assert tp_locality(spec, 4, lambda rank: f"node{rank // 2}") == (
        "; each TP group on one node, 2 TP group(s) over 2 node(s) (pack)")


def test_faults_fired_before_a_failure_are_never_blamed_for_a_later_one(tmp_path):
    # Two kills due at once (both fired during a restore) make one failure; the recovery deals
    # with both. The second must not be blamed, minutes later, for an unrelated failure, or that
    # failure's detection would be counted from the old kill (and taken out of productive time).
    clock = FaultClock(_spec(tmp_path), workers=None, clock=lambda: 0.0, log=print)
    clock.fired = {0: FaultFired(0, "kill_rank", rank=0, time=100.0), 1: FaultFired(1, "kill_rank", rank=3, time=100.0)}
    assert clock.take_fired().fault_id == 0
    clock.sweep_fired(before=100.5)
    assert clock.take_fired() is None
    clock.fired[2] = FaultFired(2, "kill_rank", rank=1, time=300.0)
    clock.sweep_fired(before=250.0)  # a failure noticed before this kill fired leaves it armed
    assert clock.take_fired().fault_id == 2


def test_a_windowed_storage_fault_stays_armed_for_ranks_that_join_later(tmp_path):
    # A replaced rank gets the faults still armed; a storage fault over a window of job seconds
    # must reach it too, or the experiment's storage turns fast after the first recovery.
    clock = FaultClock(_spec(tmp_path), workers=None, clock=lambda: 0.0, log=print)
    clock.faults = [as_armed(f, i) for i, f in enumerate([
        {"kind": "storage_latency", "rank": 1, "at_seconds": 0.0, "duration_s": 100.0, "delay_s": 0.1},
        {"kind": "storage_error", "rank": 1, "at_step": 10, "duration_s": None},
        {"kind": "kill_rank", "rank": 2, "at_step": 5}])]
    clock.fired = {i: FaultFired(i, clock.faults[i].kind) for i in range(3)}
    assert [f.id for f in clock.armed()] == [0]


def test_rank_processes_start_with_the_staging_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    workers = RayWorkerGroup(_spec(tmp_path), env_vars={"GLOO_SOCKET_IFNAME": "lo"})
    assert workers.env_vars == {"GLOO_SOCKET_IFNAME": "lo", **staging_env({})}
    assert "x86_non_temporal_threshold" in workers.env_vars["GLIBC_TUNABLES"]


def test_the_docstring_diagram_is_the_transition_table():
    from orchestrator.controller import states

    assert states.diagram() in states.__doc__
    assert set(TRANSITIONS) == set(State) and not TRANSITIONS[State.SUCCEEDED] and not TRANSITIONS[State.FAILED]
    # Every non-terminal state can fail; growing back goes straight to a new rendezvous.
    assert all(State.FAILED in TRANSITIONS[s] for s in State if s not in TERMINAL)
    assert State.RENDEZVOUS in TRANSITIONS[State.RUNNING] and State.RECOVERING not in TRANSITIONS[State.PLACING]


def test_an_illegal_transition_is_a_bug_that_fails_the_job(tmp_path, rendezvous):
    from orchestrator.controller.states import IllegalTransition, Running

    spec = _spec(tmp_path)
    lines: list[str] = []
    ctl = _controller(spec, FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root)), rendezvous, lines)
    with pytest.raises(IllegalTransition, match="PLACING -> RUNNING"):
        ctl._go(Running(), "skipping the rendezvous")
    ctl.HANDLERS[State.PLACING] = lambda: ctl._go(Running(), "skipping the rendezvous")
    assert ctl.step_once() == State.FAILED and "IllegalTransition" in ctl.error


def test_an_error_after_the_job_ended_leaves_it_ended(tmp_path, rendezvous):
    from orchestrator.controller.states import Succeeded

    spec = _spec(tmp_path)
    ctl = _controller(spec, FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root)), rendezvous, [])

    def ends_then_raises():
        ctl.phase = Succeeded()
        raise RuntimeError("the metrics endpoint went away")

    ctl.HANDLERS[State.PLACING] = ends_then_raises
    assert ctl.step_once() == State.SUCCEEDED and ctl.error is None


def test_a_restore_that_fails_after_a_rollback_books_no_lost_work_twice(tmp_path, rendezvous):
    # Rank 1 dies at step 25 (steps 20-24 rolled back: lost work); the next generation's restore then
    # fails once. That second failure trained nothing: it must not move the same steps (nor restore
    # time) out of productive again.
    spec = _spec(tmp_path, elastic={"max_restarts": 3})
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root), die_at={25: 1})
    real, calls = workers.restore_all, []

    def restore_all(step, dp, timeout_s, faults=None):
        calls.append(step)
        if len(calls) == 2:
            raise RuntimeError("rank 0 could not restore: connection reset")
        return real(step, dp, timeout_s, faults)

    workers.restore_all = restore_all
    report = _controller(spec, workers, rendezvous, []).run()
    assert report.status == "succeeded" and calls == [None, 20, 20]
    died, restore_failed = report.failures
    assert died.lost_work_s > 0 and restore_failed.lost_work_s == 0.0
    # The restore's failure interrupted the death's recovery: both close when training runs again, the
    # first measured from its own detection (the whole outage), not left open.
    assert restore_failed.recovered_after_s is not None and died.recovered_after_s >= restore_failed.recovered_after_s
    totals = report.goodput  # against the ledger's clock (its wall_s is the buckets' own sum)
    assert abs(totals.productive_s + sum(totals.badput_s.values()) - totals.clock_wall_s) < 1e-6
