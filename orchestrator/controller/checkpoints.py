"""The controller's side of checkpointing: the plan it publishes, the commits, the restore point.

Protocol (controller thread only; one per controller run):
  * `restore_point()` in RESTORING: the newest committed step not found corrupt by this run
    (after the retention pass of the last commit, which runs on a background thread, settled);
    `on_unloadable(step, source, err)` when a restore of it (or of the memory snapshot `source`)
    found it corrupt or gone, `unreadable(step, err)` when
    it failed without proof (orchestrator.controller.restore_policy: quarantine only on proof,
    never a silent start from step 0).
  * `restore_choice(workers, after_failure)` in RESTORING: the step and level to restore (after a
    failure, a complete memory snapshot whose shards all have live holders that still hold them,
    asked then, when it is at least as new as the restore point, else storage; memory_level);
    `expected_restore_point(workers)` the same step, for the lost work a recovery books. Both first
    wait for a manifest create under way (`flush`: it lands before the step is chosen, never
    behind the restore's back; at most checkpoint.commit_timeout_s, past it SavesFailing), unless
    a memory snapshot at least as new is restored anyway.
  * `begin(store, gen, anchor, source)` once the ranks restored: the restore joins the history, nothing
    is pending, the first plan of the generation is published (`CheckpointPlan`, memory cadence in it).
  * `on_receipt(message, ...)` for each shard receipt the event intake receives: a completed
    save is committed (ckpt.commit.Committer), its blocking time booked as `checkpoint_save`,
    the interval policy fed, the job record updated, and the cadence re-planned (a new plan
    published) when the measured costs moved it. Returns the committed step, or None: the
    manifest create runs on the commit lane, off this thread, unless controller faults act
    here (then inline, so that a seeded chaos run replays), and `landed()`, called by the event
    intake at each drain, books the commits it finished the same way and returns their steps.
    `committer.committing` holds the saves whose creates are under way (a stop waits for them;
    the job's end fails once the create is overdue, `fail_if_create_overdue`, unless a signal's
    grace ends the wait).
  * `on_snapshot(message, ...)` for each memory snapshot shard held: its blocking booked (complete
    or not: the ranks stopped for it), a completed snapshot's cadence re-planned.
  * `on_save_failed(message)` when a rank could not write its shard: that save never commits.
  * `close()` at the run's end: a create under way and the last commit's retention pass finish (`SETTLE_S`).
  * `ownership_lost()`: why the driver's owner lease was lost (Stops.at_once ends the job), or None; a
    change the catalog was about to make then raises OwnershipLost instead (in JOB_ENDING).
  * `SavesFailing` is raised out of `on_receipt` / `landed` / `on_save_failed` (the controller's event
    drain) by the save that makes `checkpoint.max_failed_saves` consecutive failures, and out of `flush` /
    `fail_if_create_overdue` (a recovery, a grow, the job's end) by a create past its limit: the
    controller fails the job with its words.

A save that cannot commit does not stop the job by itself; a run of `checkpoint.max_failed_saves`
of them with no commit in between does (orchestrator.controller.save_failures).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable

from ckpt.commit import Committer
from ckpt.hf_export import data_provenance
from ckpt.hf_identity import first_weights
from ckpt.housekeeping import Housekeeper
from ckpt.ownership import OwnershipLost
from orchestrator.cluster.interruptible import SLICE_S, Interrupted, never
from orchestrator.controller.background_cost import BackgroundCost
from orchestrator.controller.ledger_snapshot import saved_goodput
from orchestrator.controller.memory_level import MemoryLevel
from orchestrator.controller.policies import CheckpointIntervalPolicy
from orchestrator.controller.restore_policy import RestorePolicy
from orchestrator.controller.save_failures import SaveFailures, SavesFailing
from orchestrator.controller.step_history import sample_events
from orchestrator.spec.job_spec import spec_hash
from orchestrator.wire.messages import CheckpointPlan, SaveFailed, ShardWritten, SnapshotHeld

# A new checkpoint cadence starts this many steps after the fastest rank's current step.
REPLAN_LEAD_STEPS = 3
# How long a restore and the run's end wait for a retention pass to stop (a hung store's is not waited out).
SETTLE_S = 10.0


# What ends the job with its own words, without a traceback: the saves keep failing, or another
# driver claimed the checkpoint root (raised by the catalog's fence before any change).
JOB_ENDING = (SavesFailing, OwnershipLost)


class Checkpoints:
    def __init__(self, spec, catalog, ledger, record, metrics, chaos, log: Callable[[str], None], fresh: bool = False,
                 lane: bool = True):
        self.spec = spec
        self.catalog = catalog
        self.ledger = ledger
        self.record = record
        record.checkpoint_interval = self._interval_s
        self.gen_begun: int | None = None  # the generation `begin` last started
        self.metrics = metrics
        self.chaos = chaos  # ControllerFaults: corrupt_shard after a commit, kill_controller around it
        self.log = log
        self.interval_policy = CheckpointIntervalPolicy(spec.checkpoint)
        self.failures = SaveFailures(spec.checkpoint.max_failed_saves, metrics, log, lambda: self.latest)
        self.committer = Committer(catalog, spec.name, spec_hash(spec), spec.checkpoint.keep,
                                   on_dropped=self.failures.dropped, fault_point=chaos.at_point,
                                   # With storage faults on the catalog, inline: which call a fault's `nth`
                                   # hits must not depend on two threads' timing (a seeded run replays);
                                   # so with a kill_controller, where the kill lands among the commit's calls.
                                   housekeeper=None if chaos.on_storage else Housekeeper("undying-ckpt-retention"),
                                   lane=Housekeeper("undying-ckpt-commit") if lane and not (
                                       chaos.on_storage or chaos.kill.armed) else None,
                                   create_limit_s=spec.checkpoint.commit_timeout_s)
        self.committer.on_skipped = self.failures.skipped
        self.run_id = uuid.uuid4().hex[:8]  # this controller run, in shard file names
        self.interrupted: Callable[[], bool] = never  # whether the job is ending (Stops.ending sets it)
        # Its reads' retries give up when the job is ending: a signal's grace is not the store's outage.
        self.restore = RestorePolicy(catalog, spec.checkpoint.read_retry_s, fresh, interrupt=self._give_up_if_ending)
        self.plan_version = 0
        self.plan: CheckpointPlan | None = None  # the one published last
        self.plan_every = self.plan_anchor = 0
        self.stop_at: int | None = None  # the generation's stop step (orchestrator.controller.stopping)
        self.store, self.gen = None, -1
        self.provenance = data_provenance(spec.data, spec.model)  # (manifests; `begin` adds the first weights')
        self.memory = MemoryLevel(spec, self.run_id, self.interval_policy, log)
        self.background = BackgroundCost()  # the steps both levels' background work slowed
        self.plan_memory_every: int | None = None
        self.plan_memory_anchor = 0
        self.blocking_booked: dict[tuple[bool, int], float] = {}  # (a snapshot's?, step) -> its blocking booked

    def ownership_lost(self) -> str | None:
        """Why this driver no longer owns the checkpoint root (its lease saw a newer claim), or None."""
        owner = self.catalog.owner
        return owner.lost if owner is not None else None

    @property
    def latest(self) -> int | None:
        return self.committer.latest

    def restore_point(self) -> int | None:
        # A pass deleting old steps would race the restore's reads (a fallback finds its step half gone).
        self.committer.stop_retention()
        self._wait(self.committer.settle, "checkpoint retention", "the restore lists the committed steps regardless")
        return self.restore.restore_point()

    def landed(self) -> list[int]:
        """The steps whose manifest creates the commit lane finished since the last call, each booked as
        `on_receipt` books an inline commit (raising as it raises: SavesFailing, OwnershipLost)."""
        return self.committer.collect(self._booked)

    def flush(self) -> None:
        """Wait for the create under way, then book what it came to: before a recovery books its rollback,
        a restore chooses its step, a grow re-forms at the newest commit (choosing a step before it lands
        would take an older one than the job holds, and its commit landing later would race the next
        generation's saves). Bounded by checkpoint.commit_timeout_s (`fail_if_create_overdue`) and by the
        job ending (`interrupted`, Stops.ending: a signal raises Interrupted, and the job ends)."""
        began = time.monotonic()
        next_line = began + SETTLE_S
        while not self.committer.flush(SLICE_S):
            self._give_up_if_ending("the manifest commit under way lands or not without it")
            self.fail_if_create_overdue()
            if time.monotonic() > next_line:
                next_line += 6 * SETTLE_S
                self.log(f"waiting {time.monotonic() - began:.0f} s for the manifest commit of step "
                         f"{min(self.committer.committing)} (a slow store; checkpoint.commit_timeout_s="
                         f"{self.committer.create_limit_s:g})")
        self.landed()

    def fail_if_create_overdue(self) -> None:
        """SavesFailing when the manifest create under way is unanswered past checkpoint.commit_timeout_s:
        what waits for it (a recovery, a grow, the job's last commit) ends the job rather than hang on a
        store that takes no writes; choosing a restore point without it could race its late landing."""
        overdue = self.committer.overdue()
        if overdue is not None:
            raise SavesFailing(f"{overdue}; it may still land as the driver exits, and a rerun resumes from the "
                               "newest commit it finds")

    def _give_up_if_ending(self, what: str = "the restore's reads are given up") -> None:
        if self.interrupted():
            raise Interrupted(f"the job is ending; {what}")

    def close(self, within_s: float = SETTLE_S) -> None:
        """The run's end: a create under way and the retention pass share `within_s` (what a grace left)."""
        lane, keeper = self.committer.lane, self.committer.housekeeper
        deadline = time.monotonic() + min(SETTLE_S, within_s)
        if lane is not None:
            self._wait(lane.close, "manifest commit", "it lands or not while the driver exits; a rerun finds "
                                                      "the step committed whole, or not at all", deadline)
            try:
                self.landed()  # a create that landed meanwhile is the job's newest commit (the report's final step)
            except JOB_ENDING as err:
                self.log(f"at the job's end: {err}")
        if keeper is not None:
            self._wait(keeper.close, "checkpoint retention", "the job ends regardless; the next run's first "
                                                             "commit, or `undying ckpt gc`, finishes it", deadline)

    def _wait(self, wait: Callable[[float], bool], what: str, otherwise: str, deadline: float | None = None) -> None:
        """`wait(seconds)` for store work until `deadline` (monotonic; None: `SETTLE_S` from now), else a line."""
        began = time.monotonic()
        if not wait(SETTLE_S if deadline is None else max(0.0, deadline - began)):
            self.log(f"{what} still running after {time.monotonic() - began:.0f} s more (a slow store): {otherwise}")

    def kept_intact(self, step: int) -> bool:
        """Whether `step` is committed by the history this run left (its restore read it damaged), by this
        very spec, and verifies whole here: a save of it was skipped, not failed, and the job has it."""
        return step in self.committer.left_behind and self.restore.kept_intact(step, self.committer.spec_hash,
                                                                              self.log)

    def on_unloadable(self, step: int, source, err: BaseException) -> str:
        """The restore of `step` failed with SnapshotUnavailable or CorruptCheckpoint; the line to print.
        From a memory snapshot (`source`): that snapshot is never chosen again, and the stored
        checkpoints are not suspected (their bytes were not read). From storage: checkpoint `step`
        is checked, moved aside when proven corrupt, and never restored again in this run."""
        if source is not None:
            return self.memory.discard(source.step, err)
        return self.restore.on_corrupt(step, err)

    def on_restore_failed(self, source, err: BaseException) -> None:
        """A restore failed otherwise (a time limit, a rank's error): a memory snapshot is not chosen again."""
        if source is not None:
            self.log(self.memory.discard(source.step, err))

    def restore_bytes(self, step: int | None, source, timeouts) -> int | None:
        """The size of what the ranks restore, for its time limit: a snapshot's from its own manifest."""
        return source.total_bytes if source is not None else timeouts.checkpoint_bytes(step, self.read_manifest)

    def unreadable(self, step: int | None, err: BaseException) -> str:
        return self.restore.unreadable(step, err)

    def read_manifest(self, step: int):
        return self.restore.read_manifest(step)

    def _live(self, workers) -> dict:
        return workers.live_actors() if self.memory.enabled else {}

    def restore_choice(self, workers, after_failure: bool) -> tuple[int | None, object]:
        """(step, memory source or None) to restore, given the worker group's live actors and what they
        hold. Only a failure's recovery restores from memory: a generation re-formed on purpose (growing
        back, a drained node) ended at a commit, and restores it. A snapshot at least as new as this
        run's newest commit and a create under way is chosen without asking storage (whose outage then
        costs nothing); the committed steps are listed when no snapshot will do or one fails to load."""
        held = workers.held_files() if after_failure and self.memory.worth_asking(self.latest) else None
        self._await_create(workers, after_failure, held)
        source = self.memory.choose(self.latest, self._live(workers), held) if after_failure else None
        if source is not None:
            return source.step, source
        step = self.restore_point()
        self.memory.on_storage_restore()  # the ranks drop what they hold as it begins
        return step, None

    def _await_create(self, workers, after_failure: bool, held: dict | None = None) -> None:
        """`flush`, unless a memory snapshot at least as new as the create under way is restored anyway: a
        store holding a create must not hold a restore that does not read it (the create lands meanwhile)."""
        newest = max([self.latest or 0, *self.committer.committing])
        if not (after_failure and self.memory.viable(newest, self._live(workers), held)):
            self.flush()

    def expected_restore_point(self, workers) -> int | None:
        """The step `restore_choice` would pick now by the holders' liveness (the lost work to book), after a create."""
        self._await_create(workers, after_failure=True)
        if self.memory.viable(self.latest, self._live(workers)):
            return self.memory.newest.step
        return self.latest

    def buddies(self, workers, world_size: int) -> dict:
        return self.memory.buddies(workers, world_size)  # the memory level's: which rank keeps whose copy

    def begin(self, store, gen: int, anchor: int | None, source=None) -> None:
        """A generation restored from `anchor` (None: fresh; `source`: the memory snapshot it came
        from): the restore joins the history (after the snapshot's sample reports), nothing is pending,
        the first plan is published."""
        self.store, self.gen = store, gen
        if self.gen_begun is None:  # this run's first restore: a resume's commit is old, and says the first weights
            resumed = self.restore.resumed(anchor)  # (None: a fresh start; unread, the metric keeps the job's start)
            if resumed is not None:
                self.metrics.on_resumed_commit(resumed.created_at)
            self.provenance.update(first_weights(self.spec.model, resumed.state if resumed is not None else None))
        self.gen_begun = gen
        if source is not None:
            self.record.history.extend(sample_events(self.memory.samples_of(source.step)))
        self.record.history.append(["restore", anchor or 0])
        if self.committer.pending:  # saves the end of the last generation interrupted: skipped, not failed
            self.metrics.on_checkpoint_skipped(len(self.committer.pending))
        # From memory, the newest durable step stays what storage holds (retention, the report's final step).
        self.committer.reset(self.committer.latest if source is not None else anchor, left_behind=self.restore.bad)
        self.blocking_booked.clear()
        self.memory.begin(gen, anchor, from_memory=source is not None)
        self.background.on_restored(anchor)
        self.stop_at = None
        if source is not None and self.plan_version:
            # From memory: the storage saves keep their steps; only the memory cadence restarts here.
            self.publish(self.plan_anchor, memory_anchor=anchor or 0, every=self.plan_every)
        else:
            self.publish(anchor or 0)
        self.metrics.on_goodput(self.ledger)  # whole from here (a predecessor's totals carried): exported

    def stop(self, step: int) -> None:
        """End the generation at completed step `step`, saved (every later plan keeps it)."""
        self.stop_at = step
        self.publish(self.plan_anchor, memory_anchor=self.plan_memory_anchor, every=self.plan_every)

    def publish(self, anchor: int, memory_anchor: int | None = None, every: int | None = None) -> None:
        """Publish a plan: storage saves every `every` steps (None: the policy's now) after `anchor`,
        memory snapshots at the policy's cadence after `memory_anchor` (None: `anchor`)."""
        times = self.record.recent_step_times()
        every, memory_every = every or self.interval_policy.every(times), self.memory.every(times)
        memory_anchor = anchor if memory_anchor is None else memory_anchor
        self.plan_every, self.plan_anchor, self.plan_memory_every = every, anchor, memory_every
        self.plan_memory_anchor = memory_anchor
        self._send(CheckpointPlan(every=every, anchor=anchor, version=0, final_step=self.spec.train.steps,
                                  tag=f"{self.run_id}g{self.gen}", job_started_at=time.time() - self.ledger.wall(),
                                  stop_at=self.stop_at, memory_every=memory_every, memory_anchor=memory_anchor,
                                  memory_complete=self.memory.newest_step()))

    def _send(self, plan: CheckpointPlan) -> None:
        """Number `plan` with the next version (a rank acts on a newer one only) and put it where every
        rank reads it at its step boundaries."""
        self.plan_version += 1
        self.plan = dataclasses.replace(plan, version=self.plan_version)
        self.store.set_plan(self.plan.to_json())

    def on_receipt(self, message: ShardWritten, world_size: int, layout: dict, restarts: int) -> int | None:
        self._book_blocking((False, message.receipt.step), message.receipt.blocking_s)
        commit = self.committer.on_receipt(
            message.receipt, message.extra, world_size, self.gen, layout,
            # The history travels with the checkpoint (with this commit's sample digests), so a rerun
            # of a dead controller knows which steps and samples the model it restores holds (the
            # data-exactly-once check). The model's architecture travels too, so a checkpoint exports
            # (`ckpt export --format hf`) and evaluates (`undying eval`) without the job spec.
            lambda samples: {"goodput": saved_goodput(self.ledger, self.record, message.receipt.step),
                             "restarts": restarts,
                             "history": [*self.record.history, *sample_events(samples)],
                             "model": self.spec.model.architecture(), "seq_len": self.spec.data.seq_len,
                             **self.provenance},
        )
        return None if commit is None else self._booked(commit)

    def _booked(self, commit) -> int:
        """A commit, inline or landed, booked: the history, the restore point, chaos, the costs, the cadence."""
        self.failures.committed()
        self.record.history.extend(sample_events(commit.samples))
        self.restore.on_committed(commit.step)
        self.chaos.after_commit(commit.step)
        self.blocking_booked = {key: s for key, s in self.blocking_booked.items() if key[0] or key[1] > commit.step}
        # Young's C is the whole cost: the blocking time and what the background write took from the
        # steps it overlapped (orchestrator.controller.background_cost).
        background = self.background.charge(commit.step, self.record.steps, self.record.last_step)
        self.interval_policy.on_save_cost(commit.blocking_s + background)
        self.record.on_checkpoint(commit.step, commit.committed_at, commit.nbytes, commit.blocking_s,
                                  commit.total_s, self._interval_s())
        self.metrics.on_interval_inputs(self.interval_policy.inputs.snapshot())
        self._replan()
        return commit.step

    def _book_blocking(self, key: tuple[bool, int], blocking_s: float) -> None:
        """A save's cost to training is its slowest rank's blocking time, booked as productive while
        it passed: moved to checkpoint_save as the receipts come in, since a save that never commits
        blocked the ranks all the same, as a memory snapshot (`key`: whether a snapshot's, its step)."""
        more = blocking_s - self.blocking_booked.get(key, 0.0)
        if more > 0:
            self.blocking_booked[key] = blocking_s
            self.record.book_save_blocking(self.ledger, key[1], more)

    def on_snapshot(self, message: SnapshotHeld, world_size: int, layout: dict, restarts: int) -> None:
        """A memory snapshot shard held; its blocking time is booked as a save's, as it comes in."""
        self._book_blocking((True, message.receipt.step), message.receipt.blocking_s)
        snap = self.memory.on_held(message, world_size, self.gen, layout, lambda samples: {})
        if snap is None:
            return None
        self.blocking_booked = {key: s for key, s in self.blocking_booked.items() if not key[0] or key[1] > snap.step}
        blocking = self.memory.last_blocking_s or 0.0
        background = self.background.charge(snap.step, self.record.steps, self.record.last_step)
        self.memory.policy.on_save_cost(blocking + background)
        self.metrics.on_memory_snapshot(snap.step, self.memory.held_bytes)
        if self.plan is not None:  # the same plan, naming the new complete snapshot: its holders keep it
            self._send(dataclasses.replace(self.plan, memory_complete=snap.step))
        self._replan()
        return None

    def _interval_s(self) -> float | None:
        """Seconds between saves: the policy's target; for a step cadence, its steps at the median step
        time (exported, so that "no commit for 3 intervals" can be alerted on whatever the cadence)."""
        seconds = self.interval_policy.interval_s()
        median = self.record.median_step_s()
        return seconds if seconds is not None or median is None else self.plan_every * median

    def _replan(self) -> None:
        """After a commit: publish a new cadence when the measured costs moved it by over 20%.

        The first plan (at restore) knows no save cost yet and probes; this is where a
        time-based interval (young, young-daly, every_seconds) takes effect. The new anchor is
        ahead of the fastest rank, so ranks picking the plan up at slightly different steps
        still agree on every save step after it."""
        times = self.record.recent_step_times()
        every, memory_every = self.interval_policy.every(times), self.memory.every(times)
        memory_moved = memory_every is not None and abs(memory_every - (self.plan_memory_every or 0)) > \
            0.2 * (self.plan_memory_every or 0)
        storage_moved = abs(every - self.plan_every) > 0.2 * self.plan_every
        if not storage_moved and not memory_moved:
            return
        current_step = self.record.completed_steps()  # the running generation's, after a rollback too
        ahead = max(self.committer.latest or 0, current_step + REPLAN_LEAD_STEPS)
        if storage_moved:
            self.publish(ahead)
        else:  # a new memory cadence alone: the storage saves stay on their steps
            self.publish(self.plan_anchor, memory_anchor=ahead, every=self.plan_every)
        memory = f"; memory snapshots every {memory_every} steps from step {ahead}" if memory_every else ""
        self.log(f"checkpoint cadence: every {self.plan_every} steps from step {self.plan_anchor} "
                 f"(interval {self.interval_policy.interval_s() or 0:.1f} s){memory}")

    def on_save_failed(self, message: SaveFailed) -> None:
        self.committer.abandon(message.step, f"rank {message.rank} failed to write its shard ({message.error})")
