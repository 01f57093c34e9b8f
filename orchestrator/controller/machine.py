"""The controller: a state machine that places, forms, restores, trains and recovers ranks.

The states, the data each carries and the legal transitions are in orchestrator.controller.states
(`TRANSITIONS`, printed by `states.diagram()`). Each state has one handler here (`HANDLERS`); a
handler does its work and moves to the next state with `_go`, which checks the edge against the
table, logs the transition as one sentence with its numbers, books wall time to the goodput bucket
of the new state and exports the state as a metric. RUNNING and CHECKPOINTING share the training
handler: saves run beside training, from a save's first receipt to its commit.

Collaborators, built here with their dependencies: FaultClock (chaos faults), Blame (which failure, whose fault),
LostWork (what a rollback redoes), EventIntake (rank events), Checkpoints (plan, commits, restore point),
Recovery (release, replace, shrink, grow), Stops (preemption, node drain, growing back: a generation ended at
a checkpointed step). Policies only return decisions; the controller acts. The worker group is injected (unit
tests drive transitions with a fake). Single-threaded but for store work (ckpt.housekeeping, ckpt.commit).
"""

from __future__ import annotations

import logging
import time

from ckpt.errors import SnapshotUnavailable
from monitor.goodput import GoodputLedger
from orchestrator.cluster.interruptible import Interrupted
from orchestrator.cluster.placement import tp_locality
from orchestrator.cluster.placement_error import PlacementError
from orchestrator.controller.blame import Blame
from orchestrator.controller.checkpoints import JOB_ENDING, Checkpoints
from orchestrator.controller.errors import normalise
from orchestrator.controller.failure_carry import carry_failures
from orchestrator.controller.fault_clock import FaultClock
from orchestrator.controller.faults import ControllerFaults
from orchestrator.controller.intake import EventIntake
from orchestrator.controller.job_record import JobRecord
from orchestrator.controller.ledger_snapshot import LedgerCarry, LedgerSnapshots
from orchestrator.controller.lost_work import LostWork
from orchestrator.controller.policies import FailureDecision, FailurePolicy, ScalingPolicy
from orchestrator.controller.recovery import Recovery
from orchestrator.controller.restore_policy import UNRESTORABLE, CorruptCheckpoint
from orchestrator.controller.states import (
    TERMINAL,
    TRANSITIONS,
    Checkpointing,
    Failed,
    Failure,
    IllegalTransition,
    Phase,
    Placing,
    Recovering,
    Rendezvous,
    Restoring,
    Running,
    State,
    Succeeded,
    TrainingRun,
)
from orchestrator.controller.stopping import Move, Stops
from orchestrator.controller.telemetry import Telemetry, slowest_restore
from orchestrator.controller.timeouts import Timeouts
from orchestrator.wire.messages import ShardWritten, SnapshotHeld
from orchestrator.wire.store import RendezvousServer

log = logging.getLogger(__name__)

# Each state's goodput bucket (a save's blocking moves to checkpoint_save per receipt; the end trains nothing).
_BUCKETS = {State.PLACING: ("startup", "reformation"), State.RENDEZVOUS: ("startup", "reformation"),
            State.RESTORING: ("checkpoint_restore",) * 2, State.RUNNING: ("productive",) * 2,
            State.CHECKPOINTING: ("productive",) * 2, State.STOPPING: ("productive",) * 2,
            State.RECOVERING: ("reformation",) * 2, **{state: ("other",) * 2 for state in TERMINAL}}


class Controller:
    def __init__(self, spec, workers, rendezvous: RendezvousServer, catalog, metrics, *,
                 printer=print, poll_s: float = 0.02, release_timeout_s: float | None = None,
                 hang_min_s: float | None = None, join_timeout_s: float = 60.0, drains=dict, fresh: bool = False,
                 commit_lane: bool = True):
        """Tests: fixed release and hang-floor seconds (else elastic.*), manifest creates inline (no commit lane)."""
        self.spec, self.workers, self.rendezvous, self.catalog = spec, workers, rendezvous, catalog
        self.metrics, self.printer, self.poll_s, self.join_timeout_s = metrics, printer, poll_s, join_timeout_s
        self.ledger = GoodputLedger()
        self.created_at = time.time()  # wall time of the ledger's start (a successor books the gap before it)
        self.snapshots = LedgerSnapshots.beside(catalog.storage, owner=catalog.owner)
        self.telemetry = Telemetry(spec, metrics, spec.monitor.heartbeat_s)
        self.record = JobRecord(spec.name, spec.train.steps, metrics, self.ledger, printer=printer,
                                mfu=self.telemetry.mfu)
        self.fault_clock = FaultClock(spec, workers, self.ledger.wall, self.log, skipped=self.record.faults_skipped)
        # Storage faults without a rank and corrupt_shard act here, on the catalog.
        self.chaos = ControllerFaults(self.fault_clock.faults, catalog, spec.chaos.seed, self.ledger.wall,
                                      printer=printer, fired=self.fault_clock.fired)
        self.blame = Blame(self.fault_clock, self.record)
        self.lost_work = LostWork(self.record, self.ledger)
        self.checkpoints = Checkpoints(spec, catalog, self.ledger, self.record, metrics, self.chaos, self.log, fresh,
                                       lane=commit_lane)
        fixed = {"hang_floor_s": hang_min_s, "release_s": release_timeout_s}
        self.timeouts = Timeouts(spec, self.record, lambda: self.telemetry.peak_flops_per_rank, self.log,
                                 join_s=join_timeout_s, retry_budget_s=self.checkpoints.restore.retry.budget_s,
                                 **{k: v for k, v in fixed.items() if v is not None})
        self.intake = EventIntake(self.record, self.fault_clock, self.chaos, self.checkpoints, metrics, self.log,
                                  on_receipt=self._on_receipt, landed=self.checkpoints.landed)
        self.failure_policy, self.scaling_policy = FailurePolicy.for_spec(spec), ScalingPolicy.for_spec(spec)
        # `drains()`: {node: deadline or None} of nodes Ray is draining (orchestrator.cluster.drain).
        self.recovery = Recovery(spec, workers, self.scaling_policy, self.log, poll_s=poll_s, metrics=metrics,
                                 release_timeout_s=self.timeouts.release_s, draining=drains)
        self.stops = Stops(spec, workers, self.checkpoints, self.record, self.ledger, self.recovery, self.intake,
                           drains, self.log, state=lambda: self.state)
        self.phase: Phase = Placing()
        self.gen, self.restarts, self.dp = -1, 0, spec.parallel.dp
        self.trained = False  # a generation trained: forming another one is re-formation (a drain, growing)
        self.restored_step = self.eval_owed = None  # the restored step and its validation owed (JobRecord.eval_owed)
        self.gen_started_at: float | None = None  # its training's start (wall); None before, and once booked
        self.failure_history, self.error = carry_failures(self.snapshots, self.failure_policy), None  # (failure_carry)
        self.carry = LedgerCarry(self.checkpoints.read_manifest, self.ledger, self.record, self.snapshots,
                                 self.created_at, self.fault_clock)
        self.store = None
        self.HANDLERS = {State.PLACING: self._placing, State.RENDEZVOUS: self._rendezvous, State.RESTORING:
                         self._restoring, State.RUNNING: self._training, State.CHECKPOINTING: self._training,
                         State.STOPPING: self._training, State.RECOVERING: self._recovering}

    @property
    def state(self) -> State:
        return self.phase.state

    @property
    def world_size(self) -> int:
        return self.dp * self.spec.parallel.tp * self.spec.parallel.pp

    def layout(self) -> dict:
        p = self.spec.parallel
        return {"dp": self.dp, "tp": p.tp, "pp": p.pp, "zero": p.zero, "world_size": self.world_size}

    def log(self, line: str) -> None:
        self.printer(f"[{self.record.job_seconds():7.2f}s] {line}")

    # ---- the machine -------------------------------------------------------------------------

    def run(self):
        p = self.spec.parallel
        self._enter(self.phase, f"placing {self.world_size} ranks (dp={self.dp} tp={p.tp} pp={p.pp})")
        while self.state not in TERMINAL:
            self.step_once()
        self.chaos.close()
        self.checkpoints.close(self.stops.end_wait_s())  # a create under way, the last retention pass
        self.ledger.stop()
        self.snapshots.save(self.ledger, ended=True, within_s=self.stops.end_wait_s())
        self.metrics.on_goodput(self.ledger)
        status = {State.SUCCEEDED: "succeeded", State.PREEMPTED: "preempted"}.get(self.state, "failed")
        return self.record.report(status, self.checkpoints.latest or 0, self.error)

    def step_once(self) -> State:
        """Run the current state's handler until the state changes: one transition (tests drive the machine
        with it). An error fails the job loudly, its checkpoints kept; a signal may end it first (Stops.at_once)."""
        before = self.state
        while self.state == before and self.state not in TERMINAL:
            try:
                if not self._take(self.stops.at_once(self.state)):
                    self.HANDLERS[self.state]()
            except Interrupted:  # a long wait given up: the job is ending, as at_once says next
                continue
            except (PlacementError, *JOB_ENDING) as err:
                self._fail_unless_ended(str(err))
            except Exception as err:  # a bug or an unexpected platform error
                log.exception("controller error in %s", self.state.value)
                self._fail_unless_ended(f"{type(err).__name__} in {self.state.value}: {err}")
        return self.state

    def _go(self, phase: Phase, sentence: str) -> None:
        if phase.state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.state.value} -> {phase.state.value} is not in TRANSITIONS")
        self._enter(phase, sentence)

    def _enter(self, phase: Phase, sentence: str) -> None:
        previous, self.phase = self.state, phase
        buckets = _BUCKETS.get(phase.state)
        if buckets is not None:
            self.ledger.enter(buckets[1] if self.restarts > 0 or self.trained else buckets[0])
        self.metrics.on_state(phase.state.value)
        arrow = f"{previous.value} -> {phase.state.value}" if previous != phase.state else phase.state.value
        self.log(f"{arrow}: {sentence}")

    def _fail(self, error: str) -> None:
        self._take(Move(Failed(error), error))

    def _take(self, move: Move | None) -> bool:
        """Make the transition a collaborator decided (False when none); a failure it found is booked as any."""
        if move is not None and move.phase.state == State.RECOVERING:
            self._start_recovery(move.phase.failure)
        elif move is not None:
            self.error = move.sentence if move.phase.state in TERMINAL else self.error
            self.dp = move.dp or self.dp
            self._go(move.phase, move.sentence)
        return move is not None

    def _fail_unless_ended(self, error: str) -> None:
        """A handler raised: fail the job, unless it raised after the job had ended (then it stays ended)."""
        if self.state in TERMINAL:
            log.error("controller error after the job ended %s: %s", self.state.value, error)
            return
        self._fail(error)

    # ---- states --------------------------------------------------------------------------------

    def _placing(self) -> None:
        started = time.perf_counter()
        spares = self.recovery.spares.target
        self.workers.place(self.world_size, spares,  # its wait for the bundles: the cluster's capacity, not ours
                           on_wait=lambda s: self.ledger.move(s, self.ledger.current, "waiting_for_resources"))
        self.workers.ensure_actors(list(range(self.world_size)))
        if spares:
            self.recovery.spares.refill("placement")
        pings = self.workers.ping_all(timeout_s=self.join_timeout_s)
        self.checkpoints.interval_policy.on_nodes(len({p.get("node") for p in pings if isinstance(p, dict)}))
        self.fault_clock.schedule(self.world_size)
        unsafe = self.fault_clock.node_kills_on(self.workers.controller_node())
        if unsafe:
            return self._fail(f"chaos.faults: kill_node on rank(s) {unsafe} would kill the node the controller runs "
                              "on; run on a multi-node cluster and target ranks on other nodes")
        nodes = len({self.workers.node_of(r) for r in range(self.world_size)})
        self._go(Rendezvous(), f"{self.world_size} rank actors up on {nodes} node(s) in "
                               f"{time.perf_counter() - started:.2f} s"
                               + (f" ({spares} warm spare(s) starting)" if spares else "")
                               + tp_locality(self.spec, self.world_size, self.workers.node_of))

    def _rendezvous(self) -> None:
        started = time.perf_counter()
        recovering = self.phase.recovering
        self.gen, self.gen_started_at = self.gen + 1, None  # (a drain's or a grow's re-formation too)
        self.store = self.rendezvous.generation(self.gen)
        try:
            limits = self.timeouts.for_generation(self.world_size)
            self.workers.join_all(self.gen, self.rendezvous.address, self.join_timeout_s,
                                  collective_timeout_s=limits.collective_s)
        except Exception as err:
            self._start_recovery(self.blame.rendezvous_failed(err))
            return
        self.record.on_layout(self.gen, self.world_size, self.dp, self.spec.parallel.tp, self.spec.parallel.pp)
        self.telemetry.on_layout(self.spec, self.dp)
        self._go(Restoring(recovering), f"generation {self.gen}: process group of {self.world_size} formed "
                                        f"in {time.perf_counter() - started:.2f} s")

    def _restoring(self) -> None:
        started = time.perf_counter()
        step = source = None
        try:
            step, source = self.checkpoints.restore_choice(self.workers, self.phase.recovering is not None)
            if step is not None:
                self.carry.carry(step)
            else:
                self.carry.start_fresh(self.checkpoints.restore.fresh)  # building the engine: start-up work
                self.ledger.enter("reformation" if self.restarts else "startup")
            size = self.checkpoints.restore_bytes(step, source, self.timeouts)
            results = self.workers.restore_all(step, self.dp, faults=self.fault_clock.armed(),
                                               timeout_s=self.timeouts.restore_s(self.world_size, size),
                                               **({"source": source} if source is not None else {}))
        except (SnapshotUnavailable, CorruptCheckpoint) as err:  # stays in RESTORING: the next call tries
            self.printer(self.checkpoints.on_unloadable(step, source, err))  # storage, or the previous one
            if source is None:
                self.metrics.on_failure("corrupt_checkpoint")
            return
        except UNRESTORABLE as err:  # no proof of corruption (the store kept failing): fail, delete nothing
            return self._fail(self.checkpoints.unreadable(step, err))
        except JOB_ENDING:  # from settling a manifest create that landed meanwhile: the job ends, no recovery
            raise
        except Exception as err:
            self.intake.drain(self.store)  # a fault that fired during the restore is its cause
            self.checkpoints.on_restore_failed(source, err)
            self._start_recovery(self.blame.restore_failed(err))
            return
        self.telemetry.on_restored(results)
        self.timeouts.on_restored(results, time.perf_counter() - started, from_storage=not source and step is not None)
        self.restored_step, self.eval_owed = step, self.record.eval_owed(step, self.spec.eval, self.spec.train.steps)
        redo = self.lost_work.on_restored(self.phase.recovering, step) + self.carry.on_restored(step)
        if self.phase.recovering is not None and step is not None:
            self.record.on_restored(self.phase.recovering.record, "memory" if source else "storage", results,
                                    time.perf_counter() - started)
        self.checkpoints.begin(self.store, self.gen, step, source)
        what = (f"restored step {step}" + (" from memory" if source else "") if step is not None
                else "fresh start (no committed checkpoint)") + redo
        if step is not None and step >= self.spec.train.steps and self.eval_owed is None:
            self._go(Succeeded(), f"{what}: the job had already finished")
            return
        self.gen_started_at = self.record.on_training_started()
        self.timeouts.on_training_started()
        self._go(Running(TrainingRun(recovering=self.phase.recovering)),
                 f"{what} in {time.perf_counter() - started:.2f} s{slowest_restore(results)}")

    def _training(self) -> None:
        """One poll of a generation's training (RUNNING or CHECKPOINTING); starts it on the first."""
        run = self.phase.run
        if not run.started:
            self._start_training(run)
        outcomes = self.workers.wait_any(self.poll_s)
        committed = self.intake.drain(self.store)
        self._track_checkpointing(run, committed)
        trouble = [o for o in outcomes if o.status != "done"]
        run.finished |= {o.rank for o in outcomes if o.status == "done"}
        if self.intake.lost_nodes:  # the root cause, even when peers' collective errors came first
            self._start_recovery(self.blame.node_lost(self.intake.lost_nodes))
        elif trouble:
            self._start_recovery(self.blame.from_outcomes(trouble))
        elif len(run.finished) == self.world_size:  # the job's end, or the generation's stop step
            self.intake.drain(self.store)
            self._take(self.stops.finished(self.phase, self.store, self.gen, self.world_size, self.dp))
        elif self.state == State.STOPPING:  # until every rank returned at the stop step, or too late
            self.telemetry.poll(self.store, self.world_size)  # the ranks saving the stop step still beat
            self._take(self.stops.overdue(self.phase)) or self._watch_hang(self.stops.save_s())
        elif not self._take(committed and not run.finished  # (no grow once ranks end the job: its last save)
                            and self.stops.grow_at(self.store, self.gen, self.dp, self.world_size, self.gen_started_at)
                            or self.stops.due(run, self.store, self.world_size, self.restored_step)):
            self.snapshots.maybe_save(self.ledger)
            self._watch_stragglers()
            self.recovery.spares.watch(settled=not self.record.awaiting_first_step)
            self.fault_clock.fire_due(self.world_size)
            self._watch_hang()

    def _watch_hang(self, saving_s: float = 0.0) -> None:
        """The progress watchdog; `saving_s`: a stop's save the ranks block on. A save writing is no hang."""
        (limit, field), saves = self.timeouts.hang_limit(saving_s), self.telemetry.saves
        hung = not saves.busy(limit) and self.blame.hang(self.record.progress_at, limit, field, saves.stalled(limit))
        if hung:
            self._start_recovery(hung)

    def _start_training(self, run: TrainingRun) -> None:
        failure = run.recovering
        if failure is not None:  # training runs again: the recovery is over, and measured (JobRecord.close_recovery)
            self.checkpoints.interval_policy.on_restart(self.record.close_recovery(failure))
            run.recovering = None
        self.workers.start_training(self.spec.train.steps, self.fault_clock.armed(), eval_at=self.eval_owed,
                                    **self.checkpoints.buddies(self.workers, self.world_size))
        run.started = self.trained = True
        self.rendezvous.drop_generations_before(self.gen)  # off the recovery's path: the ranks are training

    def _on_receipt(self, message: ShardWritten | SnapshotHeld) -> int | None:
        take = self.checkpoints.on_snapshot if isinstance(message, SnapshotHeld) else self.checkpoints.on_receipt
        return take(message, self.world_size, self.layout(), self.restarts)

    def _watch_stragglers(self) -> None:
        for rank in self.telemetry.stragglers(self.store, self.world_size, self.record, self.log,
                                              self.spec.elastic.evict_stragglers, self.workers.ready_spares):
            self.blame.evicting.add(rank)  # the eviction hook: its pending call fails, recovery replaces it
            self.workers.kill_actor_only(rank)

    def _track_checkpointing(self, run: TrainingRun, committed: list[int]) -> None:
        """RUNNING <-> CHECKPOINTING from a save's first receipt to its commit (passed through within a poll)."""
        pending = self.checkpoints.committer.unsettled
        if self.state == State.RUNNING and (pending or committed):  # committed in this poll: logged too
            step = committed[0] if committed else min(pending)
            arrived = len(pending[step].receipts) if step in pending else self.world_size
            self._go(Checkpointing(run, step), f"step {step}: shards arriving ({arrived}/{self.world_size})")
        if self.state == State.CHECKPOINTING and not pending:
            last = self.record.checkpoints[-1] if self.record.checkpoints else None
            if last is not None and last.step >= self.phase.step:
                self._go(Running(run), f"step {last.step} committed: {last.bytes / 1e6:.2f} MB, blocking "
                                       f"{last.blocking_s * 1e3:.0f} ms, total {last.total_s * 1e3:.0f} ms")
                self.snapshots.save(self.ledger)
            else:
                self._go(Running(run), f"save of step {self.phase.step} dropped (incomplete)")

    # ---- failure, recovery, growth ------------------------------------------------------------

    def _start_recovery(self, failure: Failure) -> None:
        failure.superseded = getattr(self.phase, "recovering", None) or getattr(self.phase, "failure", None)
        failure.record = self.record.on_failure(failure.kind, failure.rank, failure.detected_at,
                                                failure.fault_time, failure.message, failure.step)
        self.checkpoints.interval_policy.on_failure()
        if failure.onset is not None and self.gen_started_at is not None:  # time a training generation lost
            since = max(failure.onset, self.gen_started_at)  # from the fault (or a hang's stall)
            self.record.book_detection(self.ledger, since, failure.detected_at)
        who = f"rank {failure.rank}" if failure.rank is not None else "the job"
        after = failure.record.detected_after_s
        self._go(Recovering(failure), f"generation {self.gen}: {failure.kind} on {who}"
                                      + (f", detected after {after * 1000:.0f} ms" if after is not None else "")
                                      + f" ({normalise(failure.message)})")

    def _recovering(self) -> None:
        started = time.perf_counter()
        failure = self.phase.failure
        self.intake.drain(self.store)  # late receipts may still complete a checkpoint
        released = self.recovery.release(self.store, self.world_size, failure.errors, self.intake)
        release_s = time.perf_counter() - started
        self.failure_history.append(self.blame.attribute(failure, released.dead, released.stuck,
                                                                  released.crashed))
        failure.record.killed_at_release = released.stuck
        self.fault_clock.sweep_fired(failure.detected_at)
        restore_point = self.checkpoints.expected_restore_point(self.workers) or 0
        trained_since, self.gen_started_at = self.gen_started_at, None
        lost = self.lost_work.on_failure(failure, restore_point, trained_since)
        decision = self.failure_policy.decide(self.failure_history)
        if decision.action is FailureDecision.Action.FAIL:
            return self._fail(f"{failure.kind} on rank {failure.rank}: {decision.reason}")
        self.restarts += 1
        membership = self.recovery.replace(released.lost, self.dp)
        replace_s = time.perf_counter() - started - release_s  # a cold start, or a wait for a warming spare
        if membership.error is not None:
            return self._fail(membership.error)
        self.dp = membership.dp
        cause = f"{failure.kind} on rank {failure.rank}" if failure.rank is not None else failure.kind
        self._go(Rendezvous(recovering=failure),
                 f"generation {self.gen} -> {self.gen + 1}: {cause}; {membership.words}; "
                 f"{lost:.2f} s of work after step {restore_point} to redo; "
                 f"{decision.reason}; released in {release_s:.2f} s, replaced in {replace_s:.2f} s")
