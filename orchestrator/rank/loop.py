"""A rank's autonomous training loop: steps, reports, checkpoint saves.

Runs inside `RankActor.train` on the actor's training thread. Per step it talks to nobody
but its process group; to the controller it sends, through the store:
  * rank 0 only: one `step` event per step with the global (already all-reduced) loss,
    so the controller's per-step traffic does not grow with the number of ranks;
  * every rank: a heartbeat key, at most every `monitor.heartbeat_s`, also while it waits on a
    checkpoint save (orchestrator.rank.beats);
  * every rank: a `receipt` event when its shard of a checkpoint is durable, or a
    `save_error` event when it could not be written (that save then never commits). The
    first rank of each dp replica adds the digest of the samples it consumed since the
    generation's restore (trainer.batch.SampleDigest): the controller sums the replicas'
    digests per commit, and the exactly-once check compares them with the data schedule;
  * rank 0: an `eval` event after each validation (`eval.every_steps`; every rank takes part,
    the evaluation is collective).
At every step boundary each rank reads the checkpoint plan (`PlanWatch`: one store round trip
for the plan's counter, and the plan itself only when the counter moved): a stop
step (`CheckpointPlan.stop_at`, preemption or a node drain) must reach every rank before it
passes that step, so that all of them save it and end their `train` call there together.
Events raised on the checkpoint writer's thread, or on its listener thread with a writer
process (receipts, save errors, fault notices of `during_shard_write` and of storage faults),
go through a second store client, `writer_store`: a TCPStore client is not safe to share
between threads. The notice must be sent before the fault acts (a kill at
`during_shard_write` ends the process), so it cannot wait in a queue.

Chaos on a rank: the injector gets the engine's module as its nan_grad target; storage
faults with `rank` equal to this rank are installed on the Storage its writer uses (in the
writer process, the default on object stores), so they hit this rank's shard writes
only. A step whose gradient norm is not finite (and that no fp16 loss scaler skipped)
raises `NonFiniteGradient` before anything of it is reported or saved: its update has
written NaN into the weights, and training on would only spread them. The controller then
recovers from the last committed checkpoint, like after any rank error.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time

from chaos.config import ArmedFault, rank_data_faults, rank_storage_faults
from chaos.injector import FaultInjector
from chaos.storage_faults import install_on, install_on_data
from ckpt.process_writer import STALL_S
from ckpt.writers import CheckpointWriter, abandon_stragglers, flush_within, make_writer
from orchestrator.rank.beats import Beats
from orchestrator.wire.messages import (
    CheckpointPlan,
    EvalDone,
    MemoryReport,
    Message,
    SaveFailed,
    ShardWritten,
    StepDone,
)
from orchestrator.wire.store import PLAN, GenerationStore

log = logging.getLogger(__name__)


class NonFiniteGradient(RuntimeError):
    """A training step produced a NaN or infinite gradient norm: the rank's weights are poisoned."""


def _job_started(plan: CheckpointPlan) -> float:
    """The wall time of job second 0, which storage faults' at_seconds and duration_s count from: the
    controller publishes it with the plan."""
    return plan.job_started_at if plan.job_started_at is not None else time.time()


class AbortedWhileWaiting(Exception):
    """The controller asked the generation to stop while this rank waited for a step's data, or
    behind a checkpoint save (a slow store's)."""


# On an abort, how long the rank waits for a save in flight before it leaves it to finish on its
# own: below the controller's release limit (at least 3 s), which kills a rank not out by then as
# hung, its memory snapshots with it. A save that lands within it may still commit.
ABORT_SETTLE_S = 1.0


class _EventSink:
    """push_event from the training thread on its client, from any other thread on the writer's.

    Takes typed messages (orchestrator.wire.messages) and the chaos library's fault notices,
    which are dicts of FaultFired's fields: those are decoded here, so a malformed one fails
    on the rank that made it."""

    def __init__(self, store: GenerationStore, writer_store: GenerationStore):
        self.store, self.writer_store = store, writer_store
        self.owner = threading.get_ident()

    def push(self, message: Message | dict) -> None:
        (self.store if threading.get_ident() == self.owner else self.writer_store).send(message)


def plan_from_store(store: GenerationStore, current: CheckpointPlan) -> CheckpointPlan:
    """The newest plan published; `current` while there is none newer, or it does not parse (a controller
    of another release: logged, the rank keeps its plan)."""
    data = store.get_json(PLAN)
    if not isinstance(data, dict) or not isinstance(data.get("version"), int) or data["version"] <= current.version:
        return current
    try:
        return CheckpointPlan.from_json(data)
    except ValueError as err:
        log.error("keeping checkpoint plan %d: the published one does not parse (%s): %s", current.version, err, data)
        return current


class PlanWatch:
    """A rank's copy of the checkpoint plan, read at every step boundary (training thread only).

    `read()` costs one store round trip while the plan is unchanged: the counter of the plan's
    publications (`GenerationStore.plan_sets`); the sealed body is read (two more) only when the
    counter moved. A body that does not open leaves the current plan (`plan_from_store`)."""

    def __init__(self, store: GenerationStore):
        self.store, self.sets = store, -1
        self.plan = CheckpointPlan(every=10**9, version=-1)

    def read(self) -> CheckpointPlan:
        sets = self.store.plan_sets()
        if sets != self.sets:
            self.sets, self.plan = sets, plan_from_store(self.store, self.plan)
        return self.plan


class Evaluator:
    """The validation windows of `spec.eval`, and when to evaluate. The windows are read at the
    first evaluation of a generation (inside the training loop, so a storage error there is a
    rank failure like any other) and kept for the rest of it. They are read on a thread of their
    own while the training thread waits reporting (`on_wait`, the data cursor's: the rank beats
    through an outage of the store, and an abort ends the wait)."""

    def __init__(self, spec):
        self.spec, self._windows = spec, None

    @classmethod
    def for_spec(cls, spec) -> Evaluator | None:
        return None if spec.eval is None else cls(spec)

    def windows(self, on_wait=None) -> list:
        if self._windows is None:
            from concurrent.futures import ThreadPoolExecutor

            from trainer.prefetch import wait_reporting

            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-read")
            try:
                self._windows = wait_reporting(pool.submit(self._read), on_wait)
            finally:
                pool.shutdown(wait=False)  # an abort does not wait for the read
        return self._windows

    def _read(self) -> list:
        from ckpt.storage_errors import data_read_retry
        from trainer.evaluation import eval_windows
        from trainer.tokens.reader import TokenDataset

        ev, data = self.spec.eval, self.spec.data
        dataset = TokenDataset(ev.path, ev.storage_options or data.storage_options, retry=data_read_retry(data))
        return eval_windows(dataset, ev.seq_len or data.seq_len, ev.windows)

    def due(self, completed: int, until_step: int) -> bool:
        return self.spec.eval.due(completed, until_step)


class RankLoop:
    def __init__(self, spec, engine, store: GenerationStore, rank: int, world_size: int,
                 abort: threading.Event, baseline_bytes: int = 0, *, writer_store: GenerationStore,
                 snapshots=None, release_peers=lambda: None):
        """`snapshots(tag)`: the generation's memory snapshot taker (orchestrator.rank.snapshots), None
        when the memory level is off."""
        self.spec = spec
        self.engine = engine
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.abort = abort
        self.baseline_bytes = baseline_bytes
        self.events = _EventSink(store, writer_store)  # built here: this is the training thread
        self.evaluator = Evaluator.for_spec(spec)
        self._data_step = 0  # steps done, for the data faults' gate (_data_faults; read by the prefetch thread)
        self.snapshots = snapshots
        self.release_peers = release_peers  # the group's abort (CommSockets.abort): first, when training fails

    def _on_receipt(self, receipt, extra: dict) -> None:
        self.events.push(ShardWritten(receipt, extra))

    def _on_save_error(self, step: int, err: BaseException) -> None:
        self.events.push(SaveFailed(self.rank, step, f"{type(err).__name__}: {err}"))

    def _storage_faults(self, faults: list[ArmedFault], plan: CheckpointPlan) -> functools.partial | None:
        """This rank's storage faults, as a setup to run on its writer's Storage (a fresh one per generation)."""
        mine = rank_storage_faults(faults, self.rank, restore=False)  # op: read ones are the restore's
        if not mine:
            return None
        return functools.partial(install_on, faults=mine, seed=self.spec.chaos.seed, started=_job_started(plan))

    def _data_faults(self, faults: list[ArmedFault], plan: CheckpointPlan) -> None:
        """This rank's faults on its training data reads (`target: data`), on its data cursor's datasets,
        one plan for the call: a fault with `at_step` acts from that step on (the loop keeps
        `_data_step`, the steps done, which the plan's gate reads)."""
        mine, datasets = rank_data_faults(faults, self.rank), getattr(self.engine.data, "datasets", [])
        if not (mine and datasets):
            return
        opens = {f.id: f.at_step for f in mine}  # at_step means a checkpoint's directory to the plan: kept here
        # Seeded per rank: a `probability` fault on every rank draws independently on each.
        install_on_data(datasets, self._notify_storage_fault, faults=[f.model_copy(update={"at_step": None})
                                                                      for f in mine],
                        seed=self.spec.chaos.seed * 100_003 + self.rank, started=_job_started(plan),
                        gate=lambda fault: opens[fault.id] is None or opens[fault.id] <= self._data_step)

    def _notify_storage_fault(self, event: dict) -> None:
        self.events.push(dict(event, rank=self.rank))

    def _writer(self, hook, faults: list[ArmedFault], plan: CheckpointPlan) -> CheckpointWriter:
        """The writer the spec asks for (ckpt.writers.make_writer), this rank's storage faults installed."""
        # A stalled write is given up before the controller takes the ranks blocked behind it for hung:
        # under its stall limit (orchestrator.controller.save_watch.stall_s: a numeric hang limit past 120 s).
        hang = self.spec.elastic.hang_timeout_s
        stall_s = max(STALL_S, 0.8 * hang) if isinstance(hang, float | int) else STALL_S
        return make_writer(self.spec.checkpoint, self.spec.checkpoint_root, self.rank, self._on_receipt,
                           self._on_save_error, fault_hook=hook, tag=plan.tag,
                           storage_setup=self._storage_faults(faults, plan), notify=self._notify_storage_fault,
                           stall_s=stall_s)

    def _beats(self, writers: list[CheckpointWriter]) -> Beats:
        """This call's heartbeats; the writers beat through them while training waits on a save, the
        data cursor while it waits for a step's data."""
        beats = Beats(self.store, self.rank, self.spec.monitor.heartbeat_s,
                      lambda: sum(w.written_bytes for w in writers), done_step=lambda: self.engine.next_step - 1)

        def waiting_on_a_save() -> None:
            self._left_if_aborted()  # the release must not wait out a slow store's save
            beats.while_blocked()

        for w in writers:
            w.on_wait = waiting_on_a_save
            w.wait_tick_s = min(w.wait_tick_s, self.spec.monitor.heartbeat_s)

        def waiting_for_data(waited_s: float) -> None:
            self._left_if_aborted()  # the release must not wait out the data store's outage
            beats.while_reading(waited_s)

        self.engine.data.on_wait = waiting_for_data
        return beats

    def _check_finite(self, result) -> None:
        if not result.skipped and not math.isfinite(result.grad_norm):
            raise NonFiniteGradient(f"non-finite gradient norm at step {result.step} on rank {self.rank} "
                                    f"({result.grad_norm}); the weights are poisoned, recover from the last "
                                    "committed checkpoint")

    def _step_event(self, result) -> StepDone:
        return StepDone(step=result.step, loss=result.loss, tokens=result.tokens, step_s=result.step_s,
                        time=time.time(), compute_s=result.compute_s, grad_norm=result.grad_norm, lr=result.lr,
                        bubble=result.bubble, loss_scale=result.loss_scale, data_wait_s=result.data_wait_s)

    def _save_extra(self) -> dict:
        extra = {"engine": self.engine.state_meta()} if self.rank == 0 else {}
        if self.engine.tp_rank == 0 and self.engine.pp_rank == 0:  # one report per dp replica
            extra["samples"] = self.engine.data.consumed.to_json()
        return extra

    def _evaluate(self, completed: int) -> None:
        started = time.perf_counter()
        loss_sum, tokens = self.engine.evaluate(self.evaluator.windows(self.engine.data.on_wait), self._left_if_aborted)
        if self.rank == 0:
            self.events.push(EvalDone(step=completed, loss=loss_sum / tokens, tokens=tokens,
                                      seconds=time.perf_counter() - started))

    def _report_memory(self) -> None:
        """Rank 0, once per generation after its first step: measured memory by ledger."""
        from trainer.memory_probe import measure

        self.events.push(MemoryReport(measure(self.engine, self.baseline_bytes)))

    def _left_if_aborted(self) -> None:
        """AbortedWhileWaiting at an abort, asked inside the waits and work a step may hold: a save, the
        data, a validation's microbatches (the release limit is a step's time, not theirs)."""
        if self.abort.is_set():
            raise AbortedWhileWaiting("abort requested by the controller")

    def _aborted(self) -> dict:
        return {"status": "aborted", "rank": self.rank, "step": self.engine.next_step,
                "error": "abort requested by the controller"}

    def run(self, until_step: int, faults: list[ArmedFault], eval_at: int | None = None) -> dict:
        """Train to `until_step`; `eval_at`: the restored step's validation, owed (the generation that
        owed it ended during it, or a rerun never saw it: JobRecord.eval_owed), run before the first step."""
        plans = PlanWatch(self.store)
        plan = plans.read()
        hook = FaultInjector.hook_for(faults, self.rank, self.events.push, target=self.engine.model)
        self.engine.fault_hook = hook
        self._data_step = self.engine.next_step
        self._data_faults(faults, plan)
        writer = self._writer(hook, faults, plan)
        snapshots = self.snapshots(plan.tag) if self.snapshots is not None else None
        writers = self.writers = [writer] + ([snapshots.writer] if snapshots is not None else [])
        beats = self._beats(writers)
        first, left_cleanly = True, False
        try:
            if eval_at is not None and self.evaluator is not None and eval_at == self.engine.next_step:
                self._evaluate(eval_at)
            while self.engine.next_step < until_step:
                if self.abort.is_set():
                    return self._aborted()
                result = self.engine.train_step()
                self._check_finite(result)
                if self.rank == 0:
                    self.events.push(self._step_event(result))
                    if first:
                        self._report_memory()
                first = False
                beats.after_step(result.step, result.compute_s)
                plan = plans.read()
                completed = self._data_step = self.engine.next_step
                if plan.should_save(completed) or plan.stops(completed):
                    beats.saving(completed)  # before: a synchronous save is written inside `save`
                    writer.save(completed, self.engine.state_slices(copy=False), self._save_extra())
                if snapshots is not None:
                    snapshots.held.protect(plan.memory_complete)
                if snapshots is not None and plan.snapshot_due(completed):
                    beats.saving(completed)
                    snapshots.take(completed, self.engine.state_slices(copy=False), self._save_extra())
                if self.evaluator is not None and self.evaluator.due(completed, until_step):
                    self._evaluate(completed)
                if plan.stops(completed):
                    break
            left_cleanly = True
        except AbortedWhileWaiting:  # for a step's data (or the memory probe's look at the next), behind a save
            return self._aborted()
        finally:
            # On an abort or an error, a save still in flight gets ABORT_SETTLE_S, then is abandoned:
            # the release must not wait, and a save that outlives its generation never commits.
            if not left_cleanly:  # the peers first: they may be blocked in a collective with this rank
                self.release_peers()
                abandon_stragglers(writers, ABORT_SETTLE_S)
        return self._land_saves(writers)

    def _land_saves(self, writers: list[CheckpointWriter]) -> dict:
        """At the end or at a stop step the saves land before the call returns. A memory snapshot still
        copying to its buddy (up to a minute) is older than the storage save, never chosen over its
        commit, and waited for it would hold the stop past its deadline: it gets the settle time, then goes."""
        try:
            flush_within(writers[:1], None)
            abandon_stragglers(writers[1:], ABORT_SETTLE_S)
        except AbortedWhileWaiting:  # the controller gave up on this stop (past its deadline)
            abandon_stragglers(writers, ABORT_SETTLE_S)
            return self._aborted()
        return {"status": "done", "rank": self.rank, "step": self.engine.next_step,
                "ckpt_waits": writers[0].waited}
