r"""The controller: an explicit state machine that places, forms, restores, runs and recovers ranks.

    PLACING -> RENDEZVOUS -> RESTORING -> RUNNING <-> CHECKPOINTING
                   ^                         |   \-> SUCCEEDED
                   +------- RECOVERING <-----+ (rank died, aborted, hung; or growing back)
                                |-> FAILED (budget spent, crash loop, cannot shrink further)

Each state is one method that does its work and returns the next state; `_go` logs the
transition as one sentence with its numbers, books wall time to the goodput bucket of the
new state and exports the state as a metric. Policies (failure, scaling, checkpoint
interval) are injected and only return decisions; this class is the only one that acts.
The worker group is injected too, so unit tests drive transitions with a fake group.

Single-threaded: everything, including event handling and commits, runs on the thread that
calls `run()`. Checkpoints are saved by the ranks while RUNNING (the rank loop decides the
step from the published plan) and committed here as receipts arrive.
"""

from __future__ import annotations

import logging
import time
import uuid

from chaos.config import STORAGE_KINDS
from ckpt.commit import Committer
from ckpt.reader import CorruptCheckpoint, read_manifest, verify_checkpoint
from monitor.goodput import GoodputLedger
from monitor.report import StragglerRecord
from orchestrator.cluster.worker_group import PlacementError
from orchestrator.controller.faults import ControllerFaults
from orchestrator.controller.job_record import JobRecord
from orchestrator.controller.ledger_snapshot import LedgerSnapshots, resume_totals
from orchestrator.controller.policies import CheckpointIntervalPolicy, FailurePolicy, ScalingPolicy
from orchestrator.controller.recovery import RecoveryMixin
from orchestrator.controller.states import TERMINAL, Failure, State
from orchestrator.controller.telemetry import Telemetry
from orchestrator.spec.job_spec import spec_hash
from orchestrator.wire.store import PLAN, RendezvousServer

log = logging.getLogger(__name__)


class Controller(RecoveryMixin):
    def __init__(self, spec, workers, rendezvous: RendezvousServer, catalog, metrics, *,
                 printer=print, poll_s: float = 0.02, release_timeout_s: float = 3.0,
                 hang_min_s: float = 10.0, hang_factor: float = 5.0, join_timeout_s: float = 60.0):
        self.spec = spec
        self.workers = workers
        self.rendezvous = rendezvous
        self.catalog = catalog
        self.metrics = metrics
        self.printer = printer
        self.poll_s = poll_s
        self.release_timeout_s = release_timeout_s
        self.hang_min_s = hang_min_s
        self.hang_factor = hang_factor
        self.join_timeout_s = join_timeout_s
        self.ledger = GoodputLedger()
        self.created_at = time.time()  # wall time of the ledger's start (a successor books the gap before it)
        self.snapshots = LedgerSnapshots(catalog.storage)
        self.telemetry = Telemetry(spec, metrics, spec.monitor.heartbeat_s)
        self.record = JobRecord(spec.name, spec.train.steps, metrics, self.ledger, printer=printer,
                                mfu=self.telemetry.mfu)
        self.committer = Committer(catalog, spec.name, spec_hash(spec), spec.checkpoint.keep,
                                   on_dropped=self._on_save_dropped,
                                   fault_point=lambda point, step: self.chaos.at_point(point, step))
        self.failure_policy = FailurePolicy(spec.elastic.max_restarts, spec.elastic.crash_loop_limit)
        self.scaling_policy = ScalingPolicy(spec.parallel.dp, spec.elastic.min_dp, spec.train.global_batch,
                                            spec.train.micro_batch, spec.parallel.tp * spec.parallel.pp)
        self.interval_policy = CheckpointIntervalPolicy(spec.checkpoint)
        self.state = State.PLACING
        self.gen = -1
        self.dp = spec.parallel.dp
        self.restarts = 0
        # Step- and point-triggered faults are armed in the ranks' injectors; time-triggered ones
        # (explicit at_seconds, and random ones from chaos.mtbf_s) are fired by the controller.
        # Storage faults stay armed whatever their trigger: their at_seconds opens a window.
        self.faults = [dict(f.model_dump(), id=i) for i, f in enumerate(spec.chaos.faults)
                       if f.at_seconds is None or f.kind in STORAGE_KINDS]
        # Storage faults without a rank and corrupt_shard act here, on the catalog.
        self.chaos = ControllerFaults(self.faults, catalog, spec.chaos.seed, lambda: self.ledger.wall(),
                                      printer=printer)
        self.timed: list = []  # chaos.schedule.FaultEvent, by time
        self.timed_next = 0  # index of the next one to fire
        self.fired: dict[int, dict] = {}
        self.bad_steps: set[int] = set()
        self.restored_step: int | None = None
        self.failure: Failure | None = None
        self.failure_history: list = []
        self.outcome_errors: dict[int, str] = {}
        self.lost_node_events: dict[str, dict] = {}  # node id -> first "node_lost" event
        self.nodes_handled: set[str] = set()  # lost nodes whose ranks were already dropped
        self.run_id = uuid.uuid4().hex[:8]  # this controller run, in shard file names
        self.dead_in_release: list[int] = []
        self.stuck_in_release: list[int] = []
        self.just_committed: int | None = None
        self._saving_step = -1
        self.evicting: set[int] = set()  # stragglers this controller killed on purpose
        self.open_failure = None
        self.plan_version = 0
        self.gen_started_at = time.time()
        self.error: str | None = None
        self._resumed_ledger = False

    @property
    def world_size(self) -> int:
        return self.dp * self.spec.parallel.tp * self.spec.parallel.pp

    def layout(self) -> dict:
        p = self.spec.parallel
        return {"dp": self.dp, "tp": p.tp, "pp": p.pp, "zero": p.zero, "world_size": self.world_size}

    # ---- the machine -------------------------------------------------------------------------

    def run(self):
        self._go(State.PLACING, f"placing {self.world_size} ranks ({self.layout_text()})")
        while self.state not in TERMINAL:
            try:
                self.step_once()
            except PlacementError as err:
                self._fail(str(err))
            except Exception as err:  # a bug or an unexpected platform error: fail loudly, keep checkpoints
                log.exception("controller error in %s", self.state.value)
                self._fail(f"{type(err).__name__} in {self.state.value}: {err}")
        self.chaos.close()
        self.ledger.stop()
        self.snapshots.save(self.ledger, ended=True)
        self.metrics.on_goodput(self.ledger)
        final = self.committer.latest if self.committer.latest is not None else 0
        status = "succeeded" if self.state == State.SUCCEEDED else "failed"
        return self.record.report(status, final, self.error)

    def step_once(self) -> State:
        """Run the current state's handler once (tests drive one transition at a time with it).

        CHECKPOINTING has no handler of its own: it is entered and left inside RUNNING's loop."""
        handlers = {State.PLACING: self._placing, State.RENDEZVOUS: self._rendezvous,
                    State.RESTORING: self._restoring, State.RUNNING: self._running,
                    State.RECOVERING: self._recovering}
        handlers[self.state]()
        return self.state

    def layout_text(self) -> str:
        p = self.spec.parallel
        return f"dp={self.dp} tp={p.tp} pp={p.pp}"

    def _bucket_for(self, state: State) -> str | None:
        recovering = self.restarts > 0
        return {
            State.PLACING: "reformation" if recovering else "startup",
            State.RENDEZVOUS: "reformation" if recovering else "startup",
            State.RESTORING: "checkpoint_restore",
            State.RUNNING: "productive",
            State.CHECKPOINTING: "productive",  # saves run beside training; their blocking part is moved later
            State.RECOVERING: "reformation",
        }.get(state)

    def _go(self, state: State, sentence: str) -> None:
        previous = self.state
        self.state = state
        bucket = self._bucket_for(state)
        if bucket is not None:
            self.ledger.enter(bucket)
        self.metrics.on_state(state.value)
        arrow = f"{previous.value} -> {state.value}" if previous != state else state.value
        self.printer(f"[{self.record.job_seconds():7.2f}s] {arrow}: {sentence}")

    def _fail(self, error: str) -> None:
        self.error = error
        self._go(State.FAILED, error)

    # ---- states --------------------------------------------------------------------------------

    def _placing(self) -> None:
        started = time.perf_counter()
        spares = self.spec.elastic.spares
        self.workers.place(self.world_size, spares)
        self.workers.ensure_actors(list(range(self.world_size)))
        if spares:
            self.workers.start_spares()
        pings = self.workers.ping_all(timeout_s=self.join_timeout_s)
        self.interval_policy.on_nodes(len({p.get("node") for p in pings if isinstance(p, dict)}))
        self._schedule_timed_faults()
        unsafe = self._node_kills_on_controller_node()
        if unsafe:
            self._fail(f"chaos.faults: kill_node on rank(s) {unsafe} would kill the node the controller runs on; "
                       "run on a multi-node cluster and target ranks on other nodes")
            return
        nodes = len({self.workers.node_of(r) for r in range(self.world_size)})
        self._go(State.RENDEZVOUS, f"{self.world_size} rank actors up on {nodes} node(s) in "
                                   f"{time.perf_counter() - started:.2f} s"
                                   + (f" ({spares} warm spare(s) starting)" if spares else "") + self._tp_locality())

    def _tp_locality(self) -> str:
        """Words on where the TP groups landed: one node each, and over how many nodes.

        Each TP group is one placement-group bundle, so at placement it always shares a node;
        a group refilled from spares on other nodes after a failure would not, and this says
        so by naming it (TP then runs at the inter-node bandwidth)."""
        tp = self.spec.parallel.tp
        groups = [list(range(start, start + tp)) for start in range(0, self.world_size, tp)]
        nodes = {self.workers.node_of(g[0]) for g in groups}
        unit = "TP group" if tp > 1 else "rank"
        spread = f"{len(groups)} {unit}(s) over {len(nodes)} node(s) ({self.spec.resources.placement})"
        split = [g for g in groups if len({self.workers.node_of(r) for r in g}) > 1]
        if tp == 1:
            return f"; {spread}"
        if not split:
            return f"; each TP group on one node, {spread}"
        return f"; WARNING: TP group(s) {split} span nodes, {spread}"

    def _quarantine(self, step: int) -> str:
        """Withdraw a checkpoint that fails the controller's own full verification, so that the
        step can be saved and committed again; one that verifies (a transient read error on a
        rank) stays committed and is only skipped by this run. Returns words for the log line."""
        try:
            try:
                verify_checkpoint(self.catalog, step)
            except CorruptCheckpoint:
                aside = self.catalog.quarantine(step)
                return f"; its manifest moved aside to {aside}"
        except (OSError, ValueError) as err:  # the storage failed us here too: skip the step, keep going
            return f"; it could not be checked or moved aside ({type(err).__name__}: {err}), skipped by this run"
        return "; it verifies here, so it stays committed (skipped by this run)"

    def _on_save_dropped(self, step: int, reason: str) -> None:
        self.printer(f"[{self.record.job_seconds():7.2f}s] checkpoint step {step} will not be committed: {reason}; "
                     "training goes on and the next save commits")
        self.metrics.on_checkpoint_skipped()

    def _node_kills_on_controller_node(self) -> list[int]:
        targets = sorted({f["rank"] for f in self.faults if f["kind"] == "kill_node"})
        targets += sorted({e.rank for e in self.timed if e.kind == "kill_node" and e.rank is not None})
        here = self.workers.controller_node()
        return [r for r in targets if self.workers.node_of(r) == here]

    def _rendezvous(self) -> None:
        started = time.perf_counter()
        self.gen += 1
        self.store = self.rendezvous.generation(self.gen)
        try:
            self.workers.join_all(self.gen, self.rendezvous.host, self.rendezvous.port, self.join_timeout_s)
        except Exception as err:
            self.outcome_errors = {}
            self._start_recovery(Failure("rendezvous", None, time.time(), f"{type(err).__name__}: {err}"))
            return
        self.record.on_layout(self.gen, self.world_size, self.dp, self.spec.parallel.tp, self.spec.parallel.pp)
        self.telemetry.on_layout(self.spec, self.dp)
        self._go(State.RESTORING, f"generation {self.gen}: process group of {self.world_size} formed "
                                  f"in {time.perf_counter() - started:.2f} s")

    def _restoring(self) -> None:
        started = time.perf_counter()
        step = None
        try:
            candidates = [s for s in self.catalog.committed_steps() if s not in self.bad_steps]
            step = candidates[-1] if candidates else None
            if step is not None:
                self._resume_ledger(step)
            else:
                self._resumed_ledger = True  # nothing to restore: building the engine is start-up work
                self.ledger.enter("reformation" if self.restarts else "startup")
            results = self.workers.restore_all(step, self.dp, timeout_s=self.join_timeout_s + 120,
                                               faults=self._armed_faults())
        except CorruptCheckpoint as err:
            self.bad_steps.add(step)
            log.error("checkpoint step %s failed to load (%s); falling back to the previous one", step, err)
            self.printer(f"checkpoint step {step} is corrupt ({err}); falling back to the previous committed one"
                         + self._quarantine(step))
            self.metrics.on_failure("corrupt_checkpoint")
            return
        except Exception as err:
            self.outcome_errors = {}
            self._start_recovery(self._restore_failure(err))
            return
        self.telemetry.on_restored(results)
        self.restored_step = step
        self.record.history.append(["restore", step or 0])
        self.committer.reset(step)
        self._publish_plan(anchor=step or 0)
        what = f"restored step {step}" if step is not None else "fresh start (no committed checkpoint)"
        if step is not None and step >= self.spec.train.steps:
            self._go(State.SUCCEEDED, f"{what}: the job had already finished")
            return
        self.gen_started_at = time.time()
        self._go(State.RUNNING, f"{what} in {time.perf_counter() - started:.2f} s")

    def _resume_ledger(self, step: int) -> None:
        """On the first restore of this invocation, carry the goodput ledger and the step history
        (orchestrator.controller.step_history: which steps the restored model holds) saved with the checkpoint.

        Only the first: later restores load checkpoints this invocation wrote itself, whose
        ledger is already in ours."""
        if self._resumed_ledger:
            return
        # ckpt.reader's read: an unparsable (torn) manifest is a CorruptCheckpoint, handled by the caller.
        manifest = read_manifest(self.catalog, step)
        state = manifest.state
        saved = state.get("goodput")
        self._resumed_ledger = True
        self.record.history[:0] = state.get("history", [])
        if not saved:
            return
        # Past the commit, the predecessor's last ledger snapshot: its rolled-back steps become
        # lost work and the time until this controller started is booked (orchestrator.controller.ledger_snapshot).
        carried = resume_totals(saved, manifest.created_at, self.snapshots.load(), self.created_at)
        now = self.ledger.totals()
        self.ledger = GoodputLedger(carried={k: carried.get(k, 0.0) + now.get(k, 0.0) for k in now})
        self._skip_faults_before(sum(carried.values()))
        self.ledger.enter("checkpoint_restore")
        self.record.ledger = self.ledger

    def _publish_plan(self, anchor: int) -> None:
        every = self.interval_policy.every([r.step_s for r in self.record.steps.values()])
        self.plan_version += 1
        self.plan_every = every
        self.store.set_json(PLAN, {"every": every, "anchor": anchor, "version": self.plan_version,
                                   "final_step": self.spec.train.steps, "tag": f"{self.run_id}g{self.gen}",
                                   "job_started_at": time.time() - self.ledger.wall()})

    def _running(self) -> None:
        if self.open_failure is not None:
            self.record.on_recovered(self.open_failure, self.failure.detected_at)
            self.interval_policy.on_restart(self.open_failure.recovered_after_s)
            self.open_failure = None
        self.workers.start_training(self.spec.train.steps, self._armed_faults())
        finished: set[int] = set()
        while True:
            outcomes = self.workers.wait_any(self.poll_s)
            self._drain_events()
            self._track_checkpointing()
            trouble = [o for o in outcomes if o.status != "done"]
            finished |= {o.rank for o in outcomes if o.status == "done"}
            if self.lost_node_events:  # the root cause, even when peers' collective errors came first
                self._start_recovery(self._node_failure())
                return
            if trouble:
                self._start_recovery(self._failure_from(trouble))
                return
            if len(finished) == self.world_size:
                self._finish()
                return
            if self.just_committed is not None and self._maybe_grow():
                return
            self.just_committed = None
            self.snapshots.maybe_save(self.ledger)
            self._watch_stragglers()
            self._fire_due_faults()
            hung = self._hang_check()
            if hung is not None:
                self._start_recovery(hung)
                return

    def _watch_stragglers(self) -> None:
        for rank in sorted(self.telemetry.poll(self.store, self.world_size)):
            ratio = self.telemetry.detector.ratios().get(rank, float("nan"))
            self.record.stragglers.append(StragglerRecord(time=self.record.job_seconds(), rank=rank, ratio=ratio))
            self.printer(f"[{self.record.job_seconds():7.2f}s] straggler: rank {rank} computes {ratio:.2f}x "
                         f"its peers' median for {self.telemetry.detector.sustain_s:.0f} s"
                         + ("; evicting it" if self.spec.elastic.evict_stragglers else ""))
            if self.spec.elastic.evict_stragglers:
                # The eviction hook: kill the rank; its pending call fails and recovery replaces it.
                self.evicting.add(rank)
                self.workers.kill_actor_only(rank)

    def _track_checkpointing(self) -> None:
        """RUNNING <-> CHECKPOINTING: a save is in flight from its first receipt to its commit."""
        if self.state == State.RUNNING and self.committer.pending:
            self._saving_step = step = min(self.committer.pending)
            self._go(State.CHECKPOINTING, f"step {step}: shards arriving "
                                          f"({len(self.committer.pending[step].receipts)}/{self.world_size})")
        elif self.state == State.CHECKPOINTING and not self.committer.pending:
            last = self.record.checkpoints[-1] if self.record.checkpoints else None
            if last is not None and last.step >= self._saving_step:
                self._go(State.RUNNING, f"step {last.step} committed: {last.bytes / 1e6:.2f} MB, blocking "
                                        f"{last.blocking_s * 1e3:.0f} ms, total {last.total_s * 1e3:.0f} ms")
                self.snapshots.save(self.ledger)
            else:
                self._go(State.RUNNING, f"save of step {self._saving_step} dropped (incomplete)")

    def _finish(self) -> None:
        self._drain_events()
        if self.committer.latest != self.spec.train.steps:
            self._fail(f"all ranks finished but the final checkpoint (step {self.spec.train.steps}) "
                       f"was not committed; latest committed is {self.committer.latest}")
            return
        self._go(State.SUCCEEDED, f"{self.spec.train.steps} steps done, final checkpoint committed, "
                                  f"goodput {self.ledger.goodput():.1%}")
