"""What the controller learns about a run, turned into the report, metrics and progress lines.

Single-threaded: only the controller calls it. Step records come from rank 0's `step`
events; a step recomputed after a rollback replaces its earlier record (the run is
deterministic, so the values agree; the replacement keeps the report to one loss per step).
Everything it records is also sent to the job's trackers as an event (monitor.events), the
end included (`report`), so the event log rebuilds this report (`undying report`).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import deque
from collections.abc import Callable

from monitor.events import end_event, goodput_event, record_event, step_event
from monitor.goodput import GoodputLedger
from monitor.metrics import JobMetrics
from monitor.report import (
    CheckpointRecord,
    EvalPoint,
    FailureRecord,
    FaultRecord,
    GoodputSummary,
    LossPoint,
    RolledBackStep,
    RunReport,
    StragglerRecord,
    WorldRecord,
    loss_curve_steps,
    progress_line,
)
from monitor.tracking import NO_TRACKING
from orchestrator.controller.step_history import record_step
from orchestrator.controller.step_log import StepLog, StepRecord
from orchestrator.wire.messages import EvalDone, StepDone

RECENT_STEPS = 200  # step executions kept in `JobRecord.recent`


class JobRecord:
    def __init__(self, job: str, total_steps: int, metrics: JobMetrics, ledger: GoodputLedger,
                 printer=print, progress_every_s: float = 2.0, mfu=lambda tokens, step_s: None,
                 tracker=NO_TRACKING):
        self.job = job
        self.total_steps = total_steps
        self.metrics = metrics
        self.ledger = ledger
        self.printer = printer
        self.mfu = mfu
        self.tracker = tracker  # monitor.tracking.Trackers: the event log, TensorBoard, W&B
        # Seconds between saves the plan targets, None while unknown (set by controller.checkpoints).
        self.checkpoint_interval: Callable[[], float | None] = lambda: None
        self.progress_every_s = progress_every_s
        self.started = time.time()
        self.carried_s = 0.0  # job seconds of the runs this one resumed (orchestrator.controller.ledger_snapshot)
        self.steps = StepLog()  # every step's newest record, by step number
        # The newest step executions, in arrival order: what "the step time now" is measured on.
        # Bounded, so that the watchdog asking every poll costs the same at step 10 and 10 million.
        self.recent: deque[StepRecord] = deque(maxlen=RECENT_STEPS)
        self.recent_dp: deque[int] = deque(maxlen=RECENT_STEPS)  # the dp each of them ran at
        self.failures: list[FailureRecord] = []
        self.faults: list[FaultRecord] = []
        self.faults_skipped: list[FaultRecord] = []  # the fault clock's (orchestrator.controller.fault_clock)
        self.checkpoints: list[CheckpointRecord] = []
        self.world: list[WorldRecord] = []
        self.stragglers: list[StragglerRecord] = []
        self.evals: list[EvalPoint] = []
        self.last_step = -1  # the newest step event's step
        self._generation_first: int | None = None  # the running generation's first step event's step
        # In event order: runs of completed steps ["steps", first, end, dp], ["restore", step]
        # per restore: which steps survive into the final model and with which layout
        # (orchestrator.controller.step_history).
        self.history: list[list] = []
        self.dp = 0  # data-parallel degree of the running generation
        self.redone_steps, self.redone_s = 0, 0.0
        self.rolled_back: list[RolledBackStep] = []  # the executions that redone steps replaced
        self.in_flight_at_failure: set[int] = set()  # steps a failure interrupted: partly computed
        self._last_progress = 0.0
        self.progress_at = time.monotonic()  # the hang clock: monotonic, an NTP step never trips it
        self._awaiting_first_step: tuple[FailureRecord, float] | None = None
        self._generation_started = self._newest_seen_at = time.time()  # the newest step's arrival here
        # Seconds after the newest step's end already moved off productive (a validation, a save's
        # blocking, a booked tail): the time after a step is booked once, whoever books it.
        self._booked_since_step = 0.0
        self._detection: tuple[float, float] | None = None  # the generation's failure's booked detection window

    def on_training_started(self) -> float:
        """A generation starts training: the hang clock restarts. Returns the wall time, the
        controller's record of when the generation started (compared with rank timestamps)."""
        self.progress_at = time.monotonic()
        self._generation_first = None
        self._generation_started = self._newest_seen_at = time.time()
        self._booked_since_step, self._detection = 0.0, None
        return self._generation_started

    def carry_clock(self, carried_s: float) -> None:
        """A resumed job's job seconds (the goodput ledger's carried wall, at its first restore): the
        report's times count on from them, and those recorded before (this run's placement, a failed
        first rendezvous) move with them, so that the report has one clock."""
        shift, self.carried_s = carried_s - self.carried_s, carried_s
        for world in self.world:
            world.started_at += shift
        for record in [*self.failures, *self.faults, *self.stragglers]:
            if record.time is not None:
                record.time += shift

    def job_seconds(self, at: float | None = None) -> float:
        """Wall time `at` (now) on the job's clock: the seconds a resumed job carried over (`carried_s`,
        the goodput ledger's carried wall, set at its first restore) plus this controller's own."""
        return self.carried_s + (at if at is not None else time.time()) - self.started

    def on_step(self, event: StepDone) -> None:
        rec = StepRecord(event.step, event.loss, event.tokens, event.step_s, event.time, event.data_wait_s)
        # The wait for samples was booked as productive (the controller was RUNNING); its cause is data.
        self.ledger.move(min(event.data_wait_s, event.step_s), "productive", "data")
        if rec.step in self.steps or rec.step in self.in_flight_at_failure:
            self.in_flight_at_failure.discard(rec.step)
            if rec.step in self.steps:
                old = self.steps[rec.step]
                self.rolled_back.append(RolledBackStep(step=old.step, step_s=old.step_s,
                                                       finished_at=self.job_seconds(old.time)))
            self.redone_steps += 1
            self.redone_s += rec.step_s
        self.steps.put(rec)
        if self._generation_first is None:
            self._generation_first = rec.step
        self.recent.append(rec)
        self.recent_dp.append(self.dp)
        self.last_step, self._booked_since_step, self._newest_seen_at = rec.step, 0.0, time.time()
        record_step(self.history, rec.step, self.dp)
        self.progress_at = time.monotonic()
        if self._awaiting_first_step is not None:
            failure, since = self._awaiting_first_step
            failure.first_step_after_s = rec.time - since
            self._awaiting_first_step = None
            self._failure_changed(failure)
        # fp32 and bf16 train unscaled (1.0); fp16 reports its dynamic loss scale.
        if event.bubble:  # measured idle fraction of rank 0's pipeline stage (pp > 1)
            self.metrics.on_bubble(event.bubble)
        mfu = self.mfu(rec.tokens, rec.step_s)
        self.metrics.on_step(rec.step, rec.step_s, rec.tokens, rec.loss, event.grad_norm,
                             mfu=mfu, loss_scale=event.loss_scale,
                             data_wait_s=event.data_wait_s)
        self.tracker.emit(step_event(rec.step, rec.loss, rec.tokens, rec.step_s, self.job_seconds(rec.time), mfu,
                                     event.grad_norm))
        if time.monotonic() - self._last_progress >= self.progress_every_s or rec.step + 1 == self.total_steps:
            self._last_progress = time.monotonic()
            self.metrics.on_goodput(self.ledger)
            if (interval := self.checkpoint_interval()) is not None:  # also before any commit
                self.metrics.on_checkpoint_interval(interval)
            self.tracker.emit(goodput_event(rec.step + 1, self.ledger))
            self.printer(progress_line(rec.step + 1, self.total_steps, rec.loss, self.tokens_per_s(),
                                       self.ledger.goodput()))

    @property
    def generation_stepped(self) -> bool:
        """The running generation reported a step (a validation it owed before its first is no step)."""
        return self._generation_first is not None

    @property
    def awaiting_first_step(self) -> bool:
        """A failure's recovery has not yet seen its first step after the restart."""
        return self._awaiting_first_step is not None

    def completed_steps(self) -> int:
        """How many steps the newest step event says are done (0 before the first): after a
        rollback, the running generation's, not the furthest ever reached."""
        return self.last_step + 1

    def median_step_s(self, last: int = 20) -> float | None:
        """The median of the newest `last` step times, those of a wider dp than the running one's scaled
        up by the ratio: the global batch is fixed, so a rank's share of it grows as dp shrinks (dp 4 ->
        1: about 4x longer steps), and the limits derived from it (hang, release, a stop's step) must
        know at once, not 10 steps later. A narrower dp's are not scaled down (the collectives of a
        wider one cost more), so after a grow the limits stay long until its own steps replace them."""
        pairs = itertools.islice(zip(reversed(self.recent), reversed(self.recent_dp), strict=True), last)
        recent = [r.step_s * max(1.0, dp / self.dp) if dp and self.dp else r.step_s for r, dp in pairs]
        return statistics.median(recent) if recent else None

    def recent_step_times(self) -> list[float]:
        """The newest RECENT_STEPS step executions' times (the checkpoint cadence's step time)."""
        return [r.step_s for r in self.recent]

    def tokens_per_s(self, last: int = 20) -> float | None:
        recent = list(itertools.islice(reversed(self.recent), last))
        busy = sum(r.step_s for r in recent)
        return sum(r.tokens for r in recent) / busy if busy > 0 else None

    def eval_owed(self, step: int | None, evaluation, last_step: int) -> int | None:
        """Restored `step` when a validation was due there (`evaluation`: the spec's eval section, None
        without one) and none was reported: the generation that owed it ended during it, or a driver
        rerun never saw it. The ranks run it before their first step; at the job's last step it is all
        that is left to do."""
        if step is None or evaluation is None or not evaluation.due(step, last_step):
            return None
        return None if any(point.step == step for point in self.evals) else step

    def on_eval(self, event: EvalDone) -> None:
        """A validation loss from rank 0. Its time was booked as productive (the controller was
        RUNNING); it trained nothing, so it moves to `other`, as Google's taxonomy has no bucket for it."""
        self._booked_since_step += self.ledger.move(event.seconds, "productive", "other")
        self.progress_at = time.monotonic()  # progress: the hang clock restarts after a validation
        self.evals = [e for e in self.evals if e.step != event.step]  # a re-evaluation after a rollback
        self.evals.append(EvalPoint(step=event.step, loss=event.loss, tokens=event.tokens, seconds=event.seconds,
                                    time=self.job_seconds()))
        self.tracker.emit(record_event("eval", event.step, self.evals[-1]))
        self.metrics.on_eval(event.step, event.loss)
        self.printer(f"eval after step {event.step}: validation loss {event.loss:.4f} over {event.tokens} tokens "
                     f"({event.seconds:.1f} s)")

    def rolled_back_seconds(self, restored_step: int, since: float, failed_at: float | None = None) -> float:
        """Compute time of steps >= `restored_step` finished after `since` (they must be redone),
        plus the step that was in flight at `failed_at`, when the failure time is known: the
        `lost_work` of a rollback to `restored_step` (monitor.goodput defines it). `since` is the
        running generation's start (`on_training_started`), so only its steps can qualify: it reads
        those from `restored_step` on, and a recovery costs the same at step 100 and step 10^6."""
        first = self._generation_first
        if first is None:  # the generation reported no step
            return self._tail(failed_at, since) if failed_at is not None else 0.0
        done = [r for r in self.steps.records(max(restored_step, first)) if r.time >= since]
        return _compute_s(done) + (self._tail(failed_at, since) if failed_at is not None else 0.0)

    def work_seconds(self, first: int, end: int) -> float:
        """Compute time of the recorded steps first..end-1 (each step's newest run), whichever generation
        ran them: what a restore older than the step a recovery booked its rollback to throws away too."""
        return _compute_s(itertools.takewhile(lambda r: r.step < end, self.steps.records(first)))

    def book_detection(self, ledger, since: float, detected_at: float) -> float:
        """Move a failure's detection, from `since` (its fault, or a hang's stall) to `detected_at`, from
        productive to detection, less what of it was booked after the newest step already (a save's
        blocking, a validation: a fault inside them is not booked twice); returns the seconds moved. A
        save's blocking booked later (its receipt came after the detection) skips the window in turn
        (`book_save_blocking`)."""
        start = max(since, self._booked_until())
        self._detection = (start, detected_at)
        return ledger.move(max(0.0, detected_at - start), "productive", "detection")

    def book_save_blocking(self, ledger, step: int, seconds: float) -> None:
        """A save of completed step `step` blocked the ranks `seconds` more: moved from productive to
        checkpoint_save, less what the generation's booked detection took already (the save's window
        follows the newest step and what was booked after it; a fault inside it was detected from its
        onset), and counted as booked after the step (`on_save_blocking`) either way."""
        overlap = 0.0
        if self._detection is not None and step == self.last_step + 1:
            start, (d_start, d_end) = self._booked_until(), self._detection
            overlap = max(0.0, min(start + seconds, d_end) - max(start, d_start))
        ledger.move(seconds - overlap, "productive", "checkpoint_save")
        self.on_save_blocking(step, seconds)

    def _booked_until(self, since: float | None = None) -> float:
        """Where the time booked off productive after the generation's newest step ends: that step's end
        (or `since`, by default the generation's start, before it stepped) plus what was booked after it."""
        newest, started = self.steps.get(self.last_step), self._generation_started if since is None else since
        return (newest.time if newest is not None and newest.time >= started else started) + self._booked_since_step

    def on_save_blocking(self, step: int, seconds: float) -> None:
        """A save of completed step `step` blocked the ranks `seconds`, moved off productive: after
        the newest step when it is that step's save, so no tail after that step holds it."""
        if step == self.last_step + 1:
            self._booked_since_step += seconds

    @property
    def booked_since_step(self) -> float:
        """Seconds after the newest step's end already booked off productive (validation, saves' blocking)."""
        return self._booked_since_step

    def take_tail(self) -> float:
        """The seconds since the generation's newest step arrived here (its start, before one) that
        are booked nowhere else yet; the caller books them (the ranks' wait for their last save), and
        from then on they are booked. Measured on this clock alone: no rank's clock enters it."""
        tail = max(0.0, time.time() - self._newest_seen_at - self._booked_since_step)
        self._booked_since_step += tail
        return tail

    def _tail(self, at: float, since: float) -> float:
        return max(0.0, at - self._booked_until(since))

    def on_layout(self, gen: int, world_size: int, dp: int, tp: int, pp: int) -> None:
        self.world.append(WorldRecord(generation=gen, world_size=world_size, dp=dp, tp=tp, pp=pp,
                                      started_at=self.job_seconds()))
        self.dp = dp
        self.metrics.on_layout(gen, world_size, dp, tp, pp)
        self.tracker.emit(record_event("layout", self.completed_steps(), self.world[-1]))

    def on_failure(self, kind: str, rank: int | None, detected_at: float, fault_time: float | None,
                   message: str, step: int | None = None) -> FailureRecord:
        record = FailureRecord(
            time=self.job_seconds(detected_at), kind=kind, rank=rank,
            detected_after_s=None if fault_time is None else max(0.0, detected_at - fault_time),
            message=message, step=self.last_step if self.last_step >= 0 else None,
        )
        self.failures.append(record)
        if step is not None and step not in self.steps:
            self.in_flight_at_failure.add(step)
        self.metrics.on_failure(kind)
        self._awaiting_first_step = (record, fault_time if fault_time is not None else detected_at)
        self._failure_changed(record)
        return record

    def _failure_changed(self, record: FailureRecord) -> None:
        """Send the whole record again: the event log keeps the newest version of each failure."""
        index = next(i for i, f in enumerate(self.failures) if f is record)
        self.tracker.emit(record_event("failure", self.completed_steps(), record, index=index))

    def on_fault(self, notice) -> None:
        """An injected fault fired (a wire FaultFired, its time on the controller's clock)."""
        self.faults.append(FaultRecord(time=None if notice.time is None else self.job_seconds(notice.time),
                                       kind=notice.kind, fault_id=notice.fault_id, rank=notice.rank, step=notice.step,
                                       point=notice.point, detail=notice.detail))
        self.tracker.emit(record_event("fault", self.completed_steps(), self.faults[-1]))

    def on_restored(self, record: FailureRecord, level: str, results: list[dict], seconds: float) -> None:
        """The recovery of `record` restored from `level` in `seconds`; `results`: the ranks' answers. The
        level's lost work counts the failures before it whose restores did not land (this recovery took
        theirs over: a second failure during a restore), which booked their rollbacks."""
        record.restore_level, record.restore_s = level, seconds
        record.storage_read_bytes = sum(int(r.get("storage_read_bytes", 0)) for r in results if isinstance(r, dict))
        # (Open ones: a recovery that started over from step 0 restored nothing, and closed.)
        taken_over = list(itertools.takewhile(lambda f: f.restore_level is None and f.recovered_after_s is None,
                                              reversed([f for f in self.failures if f is not record])))
        lost = sum(f.lost_work_s or 0.0 for f in [record, *taken_over])
        self.metrics.on_recovery_level(level, seconds, lost)
        self._failure_changed(record)

    def on_recovered(self, record: FailureRecord, detected_at: float) -> None:
        record.recovered_after_s = time.time() - detected_at
        self.metrics.on_recovery(record.detected_after_s, record.recovered_after_s)
        self._failure_changed(record)

    def close_recovery(self, failure) -> float:
        """Training runs again after `failure`'s recovery: it, and each recovery still open when it began
        (`failure.superseded`: a second failure during the first's restore), is measured recovered, each
        from its own detection. Returns the longest: the outage the restart cost (the interval's R)."""
        longest = 0.0
        while failure is not None:
            self.on_recovered(failure.record, failure.detected_at)
            longest, failure = max(longest, failure.record.recovered_after_s), failure.superseded
        return longest

    def on_checkpoint(self, step: int, committed_at: float, nbytes: int, blocking_s: float,
                      total_s: float, interval_s: float | None) -> None:
        self.checkpoints.append(CheckpointRecord(step=step, committed_at=self.job_seconds(committed_at),
                                                 bytes=nbytes, blocking_s=blocking_s, total_s=total_s))
        self.metrics.on_checkpoint(step, nbytes, blocking_s, total_s, interval_s)
        self.tracker.emit(record_event("checkpoint", step, self.checkpoints[-1]))

    def report(self, status: str, final_step: int, error: str | None = None) -> RunReport:
        """The run's report, sent to the trackers as its `end` event too (once, at the run's end)."""
        losses = [LossPoint(step=r.step, loss=r.loss, time=self.job_seconds(r.time),
                            tokens_per_s=r.tokens / r.step_s if r.step_s > 0 else None)
                  for r in map(self.steps.__getitem__, loss_curve_steps(list(self.steps)))]
        busy, tokens = self.steps.totals()
        report = RunReport(
            job=self.job, final_step=final_step,
            final_loss=losses[-1].loss if losses else None,
            losses=losses, evals=sorted(self.evals, key=lambda e: e.step), world_history=self.world,
            failures=self.failures, faults=self.faults, faults_skipped=self.faults_skipped, history=self.history,
            checkpoints=self.checkpoints, stragglers=self.stragglers,
            redone_steps=self.redone_steps, redone_s=self.redone_s, rolled_back=self.rolled_back,
            goodput=GoodputSummary.from_ledger(self.ledger),
            status=status, error=error,
            tokens_per_s=tokens / busy if busy > 0 else None,
        )
        self.tracker.emit(goodput_event(self.completed_steps(), self.ledger))
        self.tracker.emit(end_event(report))
        return report


def _compute_s(records) -> float:
    """The steps' time less their data wait, which stays in `data` (moved at most the step's time:
    the slowest rank's wait can begin before rank 0's step does)."""
    return sum(r.step_s - min(r.data_wait_s, r.step_s) for r in records)
