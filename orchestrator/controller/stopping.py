"""Ending a healthy generation at a step boundary: preemption, node drain, growing back.

(`at_once` also ends the job when its owner lease on the checkpoint root was lost: ckpt.ownership.)

Three reasons to stop ranks that are training well, each at a checkpoint so no work is lost:
  * preemption: SIGTERM or SIGINT reached `undying run` (`ray job stop`, a Kubernetes pod
    eviction, Ctrl-C). The signal handler only calls `on_signal` (it sets a count; the
    controller thread reads it on its next poll). Training stops at the next step boundary
    every rank can still reach, that step is committed, and the job ends PREEMPTED (exit 75)
    within `elastic.preemption_grace_s`. A SIGINT after the first signal (Ctrl-C again), a signal
    outside training (nothing trained since the last commit) or an expired grace ends it at once:
    the last commit stays. A repeated SIGTERM is the same request (a pod's stoppers each send one:
    KubeRay's job stop, the head's preStop hook), still within the first one's grace.
  * node drain: Ray announced that a node holding ranks will go away (its drain table,
    orchestrator.cluster.drain). The same stop, then the node's ranks and spares are dropped
    and the job re-forms without it (warm spares, new actors elsewhere, or a smaller dp) and
    resumes from the stop step. A drain whose deadline comes before the stop step could be
    committed is a node loss (the usual recovery). Without a deadline the stop is bounded by the
    controller's progress watchdog, which keeps running in STOPPING (the hang limit, and a
    save's time while it writes: orchestrator.controller.save_watch). A signal during a
    drain's stop ends the job within the grace.
  * either: once every rank has returned and the stop step is not committed (a save failed, a
    rank read the stop late), no commit can come: after `RECEIPTS_S` the stop ends as one that
    missed its deadline.
  * growing back (`grow_at`): at a commit, when warm spares let dp grow towards its target.

How a stop step reaches every rank: `Checkpoints.stop(step)` publishes it in the checkpoint
plan (`CheckpointPlan.stop_at`), which every rank reads at every step boundary; each rank
saves that step and its `train` call returns there. Where the ranks are is estimated afresh
(`_stop_step`): the events are drained again (this poll's drain may have committed a
checkpoint, seconds during which the ranks trained on), and to the newest step record are
added the median steps that fit in the time since it was taken off the store
(`EventIntake.step_at`, or since a validation's end), but never past a validation step not yet
reported done: the ranks stand there while it runs (`_validating`). The stop step is
`stop_lead` steps past that: one for the fastest rank, which may have finished a step more
than the others (every step ends in collectives), and enough to cover the time a plan takes
to reach the ranks (`PLAN_REACH_S`).
The guarantee: when every rank reads the plan at or before the stop step, all save it and it
commits. Otherwise (steps suddenly much faster than their median, the controller held up
between the estimate and the publication) a rank that reads it late trains on past it, held in
its next step's collective by the ranks that stopped: the stop step does not commit, and the stop
ends as one that missed its deadline (a preemption ends, its last commit kept; a drain is lost).

Protocol (controller thread only). Each method returns the `Move` the controller makes (a
phase, its sentence, the new dp), or None: `at_once(state)` before every handler call; in
RUNNING/CHECKPOINTING each poll `grow_at(...)` after a commit (put off once while a create is under way;
it waits for that create after stopping the generation, then re-forms at the newest commit), else `due(...)`; in
STOPPING `overdue(phase)` each poll; `finished(phase, ...)` once every rank has returned.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.controller.states import (
    Failed,
    Failure,
    Phase,
    Preempted,
    Recovering,
    Rendezvous,
    State,
    Stopping,
    Succeeded,
    TrainingRun,
)
from orchestrator.wire.messages import FaultFired, NodeLost

# Time for a newly published plan to be read by every rank: the controller's poll, one store
# read per rank at its next step boundary, and scheduling noise, with room to spare.
PLAN_REACH_S = 0.1
# Every rank returned from `train` and the stop step is not committed: its ranks' last receipts
# (queued to the store before they returned, but unacknowledged) are surely in by then.
RECEIPTS_S = 1.0
# The least the run's end waits for each store write after a signal spent its grace: a scheduler's
# kill comes some seconds after the grace (Kubernetes' default 30 s against a 25 s grace).
END_FLOOR_S = 1.0
TRAINING = (State.RUNNING, State.CHECKPOINTING, State.STOPPING)


@dataclass(frozen=True)
class Move:
    """A transition for the controller to make: the phase, its sentence, and the new dp if it changes."""

    phase: Phase
    sentence: str
    dp: int | None = None


def preempted(sentence: str) -> Move:
    return Move(Preempted(sentence), sentence)


def stop_lead(step_s: float | None) -> int:
    """Steps between the last step the controller heard of and a stop step every rank reaches."""
    return 1 + max(1, math.ceil(PLAN_REACH_S / (step_s or 0.01)))


class Stops:
    def __init__(self, spec, workers, checkpoints, record, ledger, recovery, intake, drains: Callable[[], dict],
                 log: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 state: Callable[[], State | None] = lambda: None):
        self.spec, self.workers, self.checkpoints, self.record = spec, workers, checkpoints, record
        self.ledger, self.recovery, self.intake, self.drains = ledger, recovery, intake, drains
        self.log, self.clock, self.state = log, clock, state  # state(): the controller's state now
        self.returned_at: float | None = None  # clock() when every rank had returned, the stop uncommitted
        self.returned_run: TrainingRun | None = None  # the generation's training that returned_at is of
        self.signals: list[str] = []  # names of the signals received, in order
        self.signalled_at = 0.0  # clock() at the first: the grace counts from the signal, not from our poll
        self.drained: set[str] = set()  # drained nodes already handled (moved off, or lost)
        self.reforming = False  # stopping and re-forming a generation after a commit (a drain's, a grow's)
        self.grow_put_off: int | None = None  # the generation whose grow waited once for a create (`grow_at`)
        if workers is not None:
            workers.interrupted = self.ending
        if checkpoints is not None:
            checkpoints.interrupted = self.ending  # its wait for a manifest create under way

    def on_signal(self, signum: int, _frame=None) -> None:
        """The signal handler: records the signal, nothing else (the controller acts on its next poll)."""
        self.signalled_at = self.signalled_at or self.clock()
        self.signals.append(signal.Signals(signum).name)

    def at_once(self, state: State) -> Move | None:
        """The job ends now on a SIGINT after the first signal, on a signal outside training, or when another driver
        claimed the checkpoint root (ckpt.ownership): it fails, changing nothing more there. Called
        before each state handler; `ending()` asks the same during the handler."""
        lost = self.checkpoints.ownership_lost()
        if lost is not None:
            return Move(Failed(lost), lost)
        if "SIGINT" in self.signals[1:]:
            return preempted(f"SIGINT during the grace: stopping at once, {self.last_commit()}")
        if self.signals and self.reforming:  # its waits may outlast the grace; the commit is made
            return preempted(f"{self.signals[0]} while the job re-formed after a commit: stopping, "
                             f"{self.last_commit()}")
        if self.signals and state not in TRAINING:
            return preempted(f"{self.signals[0]} in {state.value}: nothing trained since the last commit, "
                             f"{self.last_commit()}")
        return None

    @property
    def grace_ends_at(self) -> float:
        """clock() when the first signal's grace (elastic.preemption_grace_s) ends; inf without one."""
        return self.signalled_at + self.spec.elastic.preemption_grace_s if self.signals else math.inf

    def end_wait_s(self) -> float:
        """How long the run's end may wait for each store write left (a commit under way, the last
        snapshot): what a signal's grace has left, at least END_FLOOR_S; unbounded here without one."""
        return max(END_FLOOR_S, self.grace_ends_at - self.clock())

    def ending(self) -> bool:
        """Whether the job would end now (`at_once`), asked by the worker group's long waits
        (orchestrator.cluster.interruptible): a handler that waits minutes gives up at a signal."""
        state = self.state()
        return state is not None and self.at_once(state) is not None

    def last_commit(self) -> str:
        latest = self.checkpoints.latest
        return f"last committed checkpoint (step {latest}) intact" if latest is not None else "no checkpoint committed"

    def due(self, run: TrainingRun, store, world_size: int, restored: int | None) -> Move | None:
        """A signal, or a drained node holding ranks: publish the stop step and enter STOPPING."""
        stop = self._stop(run, store, world_size, restored)
        if stop is None:
            return None
        self.checkpoints.stop(stop.step)
        self.returned_at = None
        return Move(stop, f"{stop.reason}: every rank saves step {stop.step} and stops there")

    def _stop(self, run: TrainingRun, store, world_size: int, restored: int | None) -> Stopping | None:
        if self.signals:
            reached, at, stop = self._stop_step(store, restored)
            return Stopping(run, stop, f"{self.signals[0]} at step {reached}", self.grace_ends_at)
        for node, deadline in self.drains().items():
            if node in self.drained:
                continue
            ranks = [r for r in range(world_size) if self.workers.node_of(r) == node]
            if not ranks:
                self._drop_spares_on(node)
                continue
            reached, at, stop = self._stop_step(store, restored)
            left = None if deadline is None else deadline - time.time()  # the drain's deadline is epoch time
            needed = (stop - at + 1) * (self.record.median_step_s() or 0.0) + self.save_s()
            if left is not None and left < needed:
                self._lost(node, f"deadline in {left:.1f} s, a checkpointed stop needs {needed:.1f} s")
                return None
            # Only the deadline bounds the stop, the save's time included (`needed` counts it once): ranks
            # that never reach the stop step are hung, and the stop's save gets the time it takes while it
            # writes (the hang watchdog, save_watch); an estimate would cut a first save (1 s unmeasured) short.
            budget = left if left is not None else math.inf
            return Stopping(run, stop, f"node {node[:12]} draining (rank(s) {ranks}"
                            + (f", deadline in {left:.0f} s)" if left is not None else ", no deadline)"),
                            self.clock() + budget, node)
        return None

    def _stop_step(self, store, restored: int | None) -> tuple[int, int, int]:
        """(reached, at, stop): the newest step a record says is done, where the ranks are by now
        (they went on since that record came in), and the stop step every rank can still reach.

        Drained afresh first: this poll's drain may have committed a checkpoint (seconds), as the ranks trained on."""
        self.intake.drain(store)
        # Until this generation's first step event, the newest is the last generation's: after a rollback
        # a step the ranks may be a checkpoint interval short of, so the restored step is where they are.
        reached = max(self.record.completed_steps(), restored or 0) if self.record.generation_stepped else restored or 0
        step_s = self.record.median_step_s()
        at = reached + (math.ceil(max(0.0, self.clock() - self.intake.step_at) / step_s) if step_s else 0)
        at = self._validating(reached, at)
        return reached, at, min(at + stop_lead(step_s), self.spec.train.steps)

    def _validating(self, reached: int, at: int) -> int:
        """`at`, or the first validation step from `reached` on (EvalConfig.due) not reported done: the
        ranks stand there while it runs, and the clock does not count their steps."""
        evaluation = getattr(self.spec, "eval", None)
        if evaluation is None:
            return at
        done, last = {point.step for point in self.record.evals}, self.spec.train.steps
        return next((s for s in range(max(reached, 1), at) if evaluation.due(s, last) and s not in done), at)

    def overdue(self, phase: Stopping) -> Move | None:
        """STOPPING past its deadline (a signal during a drain's stop brings it to the grace's end),
        or every rank returned and no commit of the stop step can come any more: a preemption, or a
        drain a signal came into, ends now; a drain becomes a node loss."""
        grace = self.spec.elastic.preemption_grace_s
        ends = [(phase.deadline, f"no commit of step {phase.step} within elastic.preemption_grace_s={grace:g} s"
                 if phase.node is None else f"step {phase.step} not committed before its deadline")]
        if self.signals and phase.node is not None:
            ends.append((self.grace_ends_at, f"{self.signals[0]} during the drain: no commit of step "
                                             f"{phase.step} within elastic.preemption_grace_s={grace:g} s"))
        if self.returned_at is not None and self.returned_run is phase.run:
            ends.append((self.returned_at + RECEIPTS_S, f"every rank stopped but step {phase.step} was not "
                                                        "committed (a save failed, or a rank read the stop late)"))
        deadline, why = min(ends)
        if self.clock() < deadline:
            return None
        if phase.node is None or self.signals:
            return preempted(f"{why}; stopping, {self.last_commit()}")
        self._lost(phase.node, why)
        return None

    def finished(self, phase: Phase, store, gen: int, world_size: int, dp: int) -> Move | None:
        """Every rank's `train` call returned done: the job's last step, or the generation's stop step.
        Since their last step (and validation) the ranks waited for their last save to be durable."""
        self.ledger.move(self.record.take_tail(), "productive", "checkpoint_save")
        steps = self.spec.train.steps
        if phase.state == State.STOPPING and phase.step < steps:
            return self._ended(phase, store, gen, world_size, dp)
        if self.checkpoints.latest != steps and self._receipts_may_come(phase.run):
            if self.clock() < self.grace_ends_at:  # (inf without a signal)
                return None
            return preempted(f"{self.signals[0]} as the final checkpoint (step {steps}) was being committed: not "
                             f"committed within elastic.preemption_grace_s={self.spec.elastic.preemption_grace_s:g} s "
                             "(it may still land as the driver exits: the report's final step says), "
                             f"{self.last_commit()}; a rerun resumes from the newest commit it finds")
        if self.checkpoints.latest != steps and self.checkpoints.kept_intact(steps):
            return Move(Succeeded(), f"{steps} steps done; the final checkpoint is step {steps} as committed before "
                                     "(this run's restore read it damaged, it verifies whole here), "
                                     f"goodput {self.ledger.goodput():.1%}")
        if self.checkpoints.latest != steps:
            error = (f"all ranks finished but the final checkpoint (step {steps}) was not committed; "
                     f"latest committed is {self.checkpoints.latest}"
                     + ("; its save was skipped: an earlier run committed that step, and it is not taken as this "
                        "job's (see the line above)" if steps in self.checkpoints.committer.left_behind else ""))
            if self.signals:  # stopping for a signal (its stop step was the last one): a preemption all the same
                return preempted(f"{self.signals[0]}: {error}; rerun the job to resume from it")
            return Move(Failed(error), error)
        return Move(Succeeded(), f"{steps} steps done, final checkpoint committed, goodput {self.ledger.goodput():.1%}")

    def _stop_generation(self, store, world_size: int) -> tuple[list[int], FaultFired | None]:
        """Every rank out of the generation (Recovery.stop_generation; the ranks gone meanwhile), then its
        last events taken: the steps it trained past the commit (booked as redone after this), a fault
        that fired as it stopped (marked fired: not fired again after the restore, and, dealt with by this
        re-formation, never blamed for a later failure). With ranks gone, that fault is returned: the
        cause of their failure."""
        gone = self.recovery.stop_generation(store, world_size)
        self.intake.drain(store)
        fault = self.intake.faults.take_fired() if gone else None
        self.intake.faults.sweep_fired(time.time())
        return gone, fault

    def _receipts_may_come(self, run: TrainingRun) -> bool:
        """Every rank of `run` returned and the step they stopped at is not committed yet: their last
        receipts (queued to the store before they returned, unacknowledged) may still be on their way,
        until RECEIPTS_S after the first look at this generation's (an earlier generation's look, left
        by a recovery, is not its); and while a manifest create is under way, until it lands or fails."""
        if self.checkpoints.committer.committing:
            if not self.signals:  # (with one, the grace ends the wait: preempted, not failed)
                self.checkpoints.fail_if_create_overdue()  # an unanswered create must not hold the job's end
            time.sleep(0.01)  # as below; the intake's next drain takes what the create came to
            return True
        if self.returned_at is None or self.returned_run is not run:
            self.returned_at, self.returned_run = self.clock(), run
        if self.clock() >= self.returned_at + RECEIPTS_S:
            return False
        time.sleep(0.01)  # no rank runs to wait on: the caller's poll would spin on the store
        return True

    def _ended(self, phase: Stopping, store, gen: int, world_size: int, dp: int) -> Move | None:
        """Every rank returned at the stop step: once it is committed, end the job (a signal) or
        re-form without the drained node (no work lost: nothing was trained past the commit)."""
        latest = self.checkpoints.latest
        # A stop step published late is saved where the ranks read it, after the step asked for.
        if latest is None or latest < phase.step:  # its last receipts may still be on their way
            self._receipts_may_come(phase.run)
            return self.overdue(phase)
        self.returned_at = None  # committed: the next generation's end waits for its own receipts
        if phase.node is None or self.signals:  # a signal came into a drain's stop: the job ends here
            return preempted(f"{phase.reason}: checkpoint step {latest} committed, every rank stopped; "
                             "rerun the job to resume from it")
        self.drained.add(phase.node)
        self.intake.nodes_handled.add(phase.node)  # a late node_lost report of it is not a failure
        self.ledger.enter("reformation")  # the generation's work is saved: stopping it and refilling seats re-forms
        self.reforming = True  # a signal from here gives up the waits below (`ending`): the stop is committed
        leaving = {r for r in self.workers.actors if self.workers.node_of(r) == phase.node}
        gone, fault = self._stop_generation(store, world_size)  # a rank may die while it stops, too
        moved = self.workers.forget_node(phase.node)
        failed = [r for r in gone if r not in leaving]  # (the drained node's own going is no failure)
        if failed:
            return self._lost_while_stopping(failed, phase.step, f"moving off node {phase.node[:12]}", fault)
        membership = self.recovery.replace(sorted(set(moved) | set(gone)), dp)
        self.reforming = False
        if membership.error is not None:
            return Move(Failed(membership.error), membership.error)
        return Move(Rendezvous(), f"generation {gen} -> {gen + 1}: {phase.reason}; its rank(s) moved at "
                                  f"checkpoint step {latest}, no work lost; {membership.words}", membership.dp)

    def grow_at(self, store, gen: int, dp: int, world_size: int, since: float) -> Move | None:
        """At a commit: re-form larger, at the newest commit, when warm spares let dp grow (put off once
        while a manifest create is under way); not once the job's last step is done: its final save is on."""
        last = self.record.completed_steps() >= self.spec.train.steps
        if last or (target := self.recovery.grow_to(dp, world_size)) is None:
            self.grow_put_off = None
            return None
        new_dp, ready = target
        # A create under way: grow at its landing, a later poll's (waiting here would hold the poll, and a
        # signal, on the store); once only, or a store slower than the cadence would put the grow off for ever.
        if self.checkpoints.committer.committing and self.grow_put_off != gen:
            self.grow_put_off = gen
            return None
        self.grow_put_off = None
        self.ledger.enter("reformation")  # stopping the generation and growing it re-forms; nothing trains
        at = time.time()  # the step in flight is thrown away: its time until now is lost work too
        self.reforming = True  # as in `_ended`: a signal ends the job at this commit
        gone, fault = self._stop_generation(store, world_size)
        try:  # a save completed as the generation stopped: its create lands before the step is read
            self.checkpoints.flush()  # (a commit landing after it would race the next generation)
        except BaseException:  # the job ends here (a signal, a create past its limit): its steps past the
            self.ledger.move(self.record.rolled_back_seconds(self.checkpoints.latest, since=since, failed_at=at),
                             "productive", "lost_work")  # commit are not kept
            raise
        step = self.checkpoints.latest
        self.checkpoints.memory.forget_newer(step)
        if gone:  # a rank died while the generation stopped: fill its seat first, grow at a later commit
            return self._lost_while_stopping(gone, step, "growing", fault)  # (its recovery books the redone steps)
        # Steps trained past the commit while the generation was being stopped are redone, from the commit.
        self.ledger.move(self.record.rolled_back_seconds(step, since=since, failed_at=at), "productive", "lost_work")
        mp, note = self.recovery.model_parallel(), ""
        self.workers.grow(new_dp * mp)
        self.reforming = False
        if len(self.workers.actors) < new_dp * mp:  # a spare died between the count and its promotion
            short, new_dp = new_dp, self.recovery.scaling_policy.best_dp(len(self.workers.actors)) or dp
            # Ranks 0..n-1 (a rank with no spare may sit between promoted ones); the surplus of a dp
            # that cannot hold them go back to their seats as spares, as a shrink's do.
            self.workers.renumber(sorted(self.workers.actors)[:new_dp * mp])
            note = f"; a spare died before its promotion: dp {new_dp}, not {short}"
        return Move(Rendezvous(), f"generation {gen} -> {gen + 1}: growing dp {dp} -> {new_dp} at "
                                  f"checkpoint step {step} ({ready} warm spare(s) ready{note})", new_dp)

    def _lost_while_stopping(self, gone: list[int], step: int, why: str, fault: FaultFired | None) -> Move:
        """Ranks that died (or would not leave) as a healthy generation stopped at committed `step`: a
        failure like any (an injected `fault` that fired meanwhile its cause), blamed, booked in the
        report and counted against elastic.max_restarts (a rank dying at every grow must end the job,
        not loop), its seats filled by the recovery, which books the steps trained past the commit."""
        self.reforming = False  # (no step in flight: the ranks had stopped before `step`, which is no redo when run)
        message = f"rank(s) {gone} lost as the generation stopped at checkpoint step {step} ({why})"
        kind, rank, onset = (fault.kind, fault.rank, fault.time) if fault is not None else ("rank_died", gone[0], None)
        return Move(Recovering(Failure(kind, rank, time.time(), message, fault_time=onset,
                                       errors={r: message for r in gone})), message)

    def save_s(self) -> float:
        """The last measured save's blocking time (a stop must commit one more)."""
        return self.record.checkpoints[-1].total_s if self.record.checkpoints else 1.0

    def _drop_spares_on(self, node: str) -> None:
        """A draining node holding no rank: drop the job's spares there (one still warming has no node yet)."""
        spares = self.workers.spares_on(node)
        if spares:
            self.drained.add(node)
            self.workers.forget_node(node)
            self.log(f"node {node[:12]} draining: its {spares} spare(s) dropped, no rank there")

    def _lost(self, node: str, why: str) -> None:
        """Too late for a clean stop: report the node lost (the next poll starts the recovery)."""
        self.returned_at = None  # the recovery's generation waits for its own last receipts
        self.drained.add(node)
        self.log(f"node {node[:12]} draining, {why}: handling it as a node loss")
        rank = next((r for r in sorted(self.workers.actors) if self.workers.node_of(r) == node), -1)
        self.intake.lost_nodes.setdefault(node, NodeLost(node, rank, time.time()))
