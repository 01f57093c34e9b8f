"""Prometheus metrics of one job, exported by the controller.

Protocol. The controller creates one `JobMetrics` per job, calls `serve(host, port)` once,
feeds it with the `on_*` methods from its single thread as events happen, and calls `close()`
at the end. Scrapes arrive on the exporter's own threads; prometheus-client's metric objects
are thread-safe, and the goodput series read a copy of the ledger handed over under a lock in
`on_goodput` (monitor.goodput.LedgerReading, which counts the open interval on to the scrape), so
a scrape never reads the (single-threaded) ledger itself.

Every series carries an `undying_job` label (the job spec's `name`), so several jobs can share
one Prometheus and dashboards (deploy/) can select a job. It is not `job`: Prometheus sets `job`
to the scrape job's name, and keeping an exporter's own `job` would need `honor_labels`, which
the Prometheus Operator may override (`overrideHonorLabels`).

Names follow Prometheus' conventions (`promtool check metrics` passes on a live scrape,
tests/prom): counters end in `_total`, nothing else does, and names carry their base unit
(`_seconds`, `_bytes`, `_ratio`). Rates are left to PromQL: `rate(undying_tokens_total[1m])` is
the throughput.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from monitor.goodput import GoodputLedger
from monitor.goodput_collector import GoodputCollector

# Upper bounds in seconds. Training steps range from milliseconds (tiny CPU tests) to minutes.
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Checkpoint saves, detection and recovery range from tens of milliseconds to tens of minutes.
EVENT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
PARALLEL_DIMS = ("dp", "tp", "pp")


class JobMetrics:
    """All Prometheus series of one job (see module doc for the calling protocol).

    `registry=None` gives the job a private `CollectorRegistry` rather than prometheus-client's
    global one, so two jobs (or two tests) in one process never collide on metric names.
    """

    def __init__(self, job: str, registry: CollectorRegistry | None = None) -> None:
        self.job = job
        self.registry = registry if registry is not None else CollectorRegistry()
        self._server = None
        self._thread: threading.Thread | None = None
        self._compute_s: dict[int, float] = {}
        self._states: set[str] = set()
        self._snapshot_ranks: set[int] = set()  # ranks with a memory snapshot host-bytes series
        self._memory_ledgers: dict[str, set[str]] = {}  # kind -> ledgers with a series (a probe may report fewer)
        self._define_training()
        self._define_checkpoint()
        self._define_resilience()
        self._define_levels()
        self._define_layout_model()
        # Export every job-level series from the first scrape: a histogram that appears with
        # its first observation has no zero to rate() against, and a counter that is never
        # incremented would not exist at all.
        for metric in (self.step_seconds, self.tokens, self.ckpt_blocking, self.ckpt_commit_latency,
                       self.ckpt_skipped, self.ckpt_failures, self.detection, self.recovery, self.spares_started,
                       self.spares_ready, self.spares_warming, self.data_wait):
            metric.labels(job)
        for level in ("memory", "storage"):
            for metric in (self.recoveries_by_level, self.restore_by_level, self.lost_by_level):
                metric.labels(job, level)
        for channel in ("events", "abort", "plan", "heartbeat"):  # so a first tampering is an increase()
            self.control_rejected.labels(job, channel)
        self.control_missing.labels(job, "events")
        self.ckpt_last_commit.labels(job).set(time.time())
        self.run_start.labels(job).set(time.time())
        self._trained = False  # until the first step: then `run_start` moves to when it began
        self._goodput = GoodputCollector(job)
        self.registry.register(self._goodput)

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, ["undying_job", *labels], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["undying_job"], buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        # prometheus-client appends `_total` to counter names when exposing them.
        return Counter(name, doc, ["undying_job", *labels], registry=self.registry)

    def _define_training(self) -> None:
        self.step = self._gauge("undying_step", "Global optimizer steps completed (the step a checkpoint "
                                "taken now would have).")
        self.step_seconds = self._histogram(
            "undying_step_seconds", "Wall seconds per global step.", STEP_BUCKETS
        )
        self.tokens = self._counter(
            "undying_tokens", "Global tokens trained on, steps redone after a rollback included "
            "(rate() of it is the throughput).")
        self.mfu_ratio = self._gauge("undying_mfu_ratio", "Model FLOPs utilisation (0..1).")
        self.loss = self._gauge("undying_loss", "Token-weighted global training loss of the last step.")
        self.grad_norm = self._gauge("undying_grad_norm", "Global gradient norm of the last step.")
        self.loss_scale = self._gauge("undying_loss_scale", "Dynamic loss scale (mixed precision).")
        self.eval_loss = self._gauge("undying_eval_loss", "Validation loss of the last evaluation.")
        self.eval_step = self._gauge("undying_eval_step", "Steps the last evaluated model had trained.")
        self.data_wait = self._histogram(
            "undying_data_wait_seconds", "Seconds a global step waited for its samples (the slowest rank's wait).",
            STEP_BUCKETS,
        )
        self.rank_compute = self._gauge(
            "undying_rank_step_compute_seconds", "Compute seconds of the last step, per rank.", "rank"
        )
        self.straggler = self._gauge(
            "undying_straggler", "1 while a rank is flagged as a straggler (monitor.straggler).", "rank"
        )
        self.straggler_ratio = self._gauge("undying_straggler_ratio", "A rank's median step compute over its peers' "
                                           "(its pipeline stage's) median, the straggler detector's ratio.", "rank")

    def _define_checkpoint(self) -> None:
        self.ckpt_blocking = self._histogram(
            "undying_checkpoint_blocking_seconds", "Seconds training was stopped per save.", EVENT_BUCKETS
        )
        self.ckpt_commit_latency = self._histogram(
            "undying_checkpoint_commit_latency_seconds", "Seconds from save request to commit.", EVENT_BUCKETS
        )
        self.ckpt_bytes = self._gauge("undying_checkpoint_bytes", "Bytes of the last committed checkpoint.")
        self.ckpt_step = self._gauge(
            "undying_checkpoint_last_committed_step", "Step of the last committed checkpoint."
        )
        self.ckpt_interval = self._gauge(
            "undying_checkpoint_interval_seconds", "Checkpoint interval chosen by the policy."
        )
        self.ckpt_cost = self._gauge(
            "undying_checkpoint_cost_seconds", "Interval input C: moving average of the blocking cost of a save."
        )
        self.mtbf = self._gauge(
            "undying_mtbf_seconds", "Interval input M: system MTBF estimate (prior updated with failures)."
        )
        self.restart_cost = self._gauge(
            "undying_restart_seconds", "Interval input R: moving average of the time a restart costs."
        )
        self.ckpt_skipped = self._counter(
            "undying_checkpoint_skipped", "Saves that will not be committed although nothing failed in "
            "them: still in flight when a failure or a re-formation ended their generation, or overtaken by a "
            "newer complete save before their manifest create began (a slow store).")
        self.ckpt_failures = self._counter(
            "undying_checkpoint_failures", "Failed saves: a rank's shard write, the manifest commit (twice), or "
            "shards that do not form a checkpoint (checkpoint.max_failed_saves in a row fail the job).")
        self.ckpt_last_commit = self._gauge(
            "undying_checkpoint_last_commit_timestamp_seconds", "Unix time of the last commit (before the "
            "job's first commit: the time the job started, so a job that never commits is seen).")
        # A job resumed hours after its last commit, or that waited an hour for its nodes or its restore,
        # has put nothing at risk before it trained: the no-commit alert counts from the later of the two
        # (deploy/prometheus/alerts.yml).
        self.run_start = self._gauge(
            "undying_run_start_timestamp_seconds", "Unix time this run of the job (this driver) began training: "
            "its first step's start (until then, the driver's start); a resumed job's last commit may be older.")

    def _define_levels(self) -> None:
        self.recoveries_by_level = self._counter(
            "undying_recoveries", "Recoveries by the level restored from (memory or storage).", "level")
        self.restore_by_level = self._counter(
            "undying_recovery_restore_seconds", "Seconds of restores, by level.", "level")
        self.lost_by_level = self._counter(
            "undying_recovery_lost_work_seconds", "Seconds of rolled-back work, by the level restored from.", "level")
        self.snapshot_step = self._gauge(
            "undying_memory_snapshot_step", "Step of the newest complete memory snapshot (held twice).")
        self.snapshot_host_bytes = self._gauge(
            "undying_memory_snapshot_host_bytes", "Host bytes a rank's memory level holds (staging buffer, own "
            "snapshots, buddies' copies; bounded by checkpoint.memory.max_host_bytes).", "rank")

    def on_recovery_level(self, level: str, restore_s: float, lost_s: float) -> None:
        """A recovery restored from `level` ("memory" or "storage") in `restore_s`, redoing `lost_s`."""
        self.recoveries_by_level.labels(self.job, level).inc()
        self.restore_by_level.labels(self.job, level).inc(max(0.0, restore_s))
        self.lost_by_level.labels(self.job, level).inc(max(0.0, lost_s))

    def on_memory_snapshot(self, step: int, host_bytes: Mapping[int, int]) -> None:
        """A memory snapshot of `step` completed; `host_bytes`: rank -> bytes its memory level holds."""
        self.snapshot_step.labels(self.job).set(step)
        for rank, nbytes in host_bytes.items():
            self.snapshot_host_bytes.labels(self.job, str(rank)).set(nbytes)
            self._snapshot_ranks.add(rank)

    def _define_resilience(self) -> None:
        self.failures = self._counter("undying_failures", "Failures seen, by kind.", "kind")
        self.detection = self._histogram(
            "undying_detection_seconds", "Seconds from a failure to its detection, for failures whose onset is "
            "known (an injected fault, a hang dated by its last progress).", EVENT_BUCKETS
        )
        self.recovery = self._histogram(
            "undying_recovery_seconds", "Seconds from detection to training again.", EVENT_BUCKETS
        )
        self.generation = self._gauge("undying_generation", "Membership generation.")
        self.world_size = self._gauge("undying_world_size", "Ranks in the current generation.")
        self.parallel_degree = self._gauge("undying_parallel_degree", "Parallel degree per dim.", "dim")
        self.controller_state = self._gauge(
            "undying_controller_state", "1 for the controller's current state, 0 for others.", "state"
        )
        self.control_rejected = self._counter(
            "undying_control_messages_rejected", "Control messages dropped for want of a valid tag "
            "(orchestrator.wire.auth), by channel: events, abort, plan, heartbeat.", "channel")
        self.control_missing = self._counter(
            "undying_control_messages_missing", "Queued control messages a rank sent that never reached the "
            "controller (a gap in its sequence: taken off the queue by another client, or a failed push).", "channel")
        self.spares_ready = self._gauge("undying_spares_ready", "Warm spares ready to take over a rank.")
        self.spares_warming = self._gauge("undying_spares_warming", "Spares started and still warming up.")
        self.spares_started = self._counter(
            "undying_spares_started", "Spare actors started (at placement, and to refill the pool).")

    def on_spares(self, ready: int, warming: int) -> None:
        """The spare pool now (orchestrator.controller.spare_pool)."""
        self.spares_ready.labels(self.job).set(ready)
        self.spares_warming.labels(self.job).set(warming)

    def on_spares_started(self, count: int) -> None:
        self.spares_started.labels(self.job).inc(count)

    def _define_layout_model(self) -> None:
        self.bubble_ratio = self._gauge(
            "undying_pipeline_bubble_ratio", "Idle fraction of a pipeline step: the cost model's prediction when a "
            "layout starts, then rank 0's measured value at each step (pp > 1).")
        self.memory_bytes = self._gauge(
            "undying_memory_bytes", "Per-rank memory by ledger, predicted by the cost model or measured.",
            "ledger", "kind")

    def on_bubble(self, ratio: float) -> None:
        self.bubble_ratio.labels(self.job).set(ratio)

    def on_memory(self, kind: str, ledgers: Mapping[str, float]) -> None:
        """`kind` is "predicted" or "measured"; `ledgers` maps state/activation/collective/transient to bytes.
        Each call replaces the kind's ledgers: one an earlier layout's probe measured and this one's did not
        (a sharded layout measures the state ledger alone) is dropped, not left at its old value."""
        for ledger in self._memory_ledgers.get(kind, set()) - set(ledgers):
            self.memory_bytes.remove(self.job, ledger, kind)
        self._memory_ledgers[kind] = set(ledgers)
        for ledger, nbytes in ledgers.items():
            self.memory_bytes.labels(self.job, ledger, kind).set(nbytes)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP exporter on `host:port` (0 picks a free port); returns the real port."""
        if self._server is not None:
            raise RuntimeError(f"metrics of job {self.job!r} are already served on port {self.port}")
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return self.port

    @property
    def port(self) -> int | None:
        """The port being served, or None when not serving."""
        return None if self._server is None else self._server.server_port

    def close(self) -> None:
        """Stop the exporter and release its port; safe to call when not serving."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
        self._server, self._thread = None, None

    def on_step(
        self,
        step: int,
        step_s: float,
        tokens: int,
        loss: float,
        grad_norm: float | None,
        mfu: float | None = None,
        loss_scale: float | None = None,
        data_wait_s: float | None = None,
    ) -> None:
        """A global step finished: `step` its index (from 0; `undying_step` exports the steps done,
        step + 1, as checkpoint and validation steps count), `tokens` the global tokens of that step,
        `step_s` its wall time.

        Optional values left as None (not measured by this engine) keep their last exported value.
        """
        job = self.job
        if not self._trained:  # the start-up (placement, rendezvous, restore) put nothing at risk
            self._trained = True
            self.run_start.labels(job).set(time.time() - step_s)
        self.step.labels(job).set(step + 1)  # `step` counts from 0; checkpoint and eval steps count steps done
        self.step_seconds.labels(job).observe(step_s)
        self.tokens.labels(job).inc(max(0, tokens))
        self.loss.labels(job).set(loss)
        if grad_norm is not None:
            self.grad_norm.labels(job).set(grad_norm)
        if mfu is not None:
            self.mfu_ratio.labels(job).set(mfu)
        if loss_scale is not None:
            self.loss_scale.labels(job).set(loss_scale)
        if data_wait_s is not None:
            self.data_wait.labels(job).observe(data_wait_s)

    def on_eval(self, step: int, loss: float) -> None:
        """A validation loss (trainer.evaluation) of the model after `step` steps."""
        self.eval_loss.labels(self.job).set(loss)
        self.eval_step.labels(self.job).set(step)

    def on_checkpoint(self, step: int, nbytes: int, blocking_s: float, total_s: float,
                      interval_s: float | None) -> None:
        """A checkpoint was committed (its manifest is durable). `interval_s`: the interval between saves
        the plan now targets (for a step cadence, its steps at the median step time); None: not known."""
        job = self.job
        self.ckpt_last_commit.labels(job).set(time.time())
        self.ckpt_step.labels(job).set(step)
        self.ckpt_bytes.labels(job).set(nbytes)
        self.ckpt_blocking.labels(job).observe(blocking_s)
        self.ckpt_commit_latency.labels(job).observe(total_s)
        if interval_s is not None:
            self.ckpt_interval.labels(job).set(interval_s)

    def on_interval_inputs(self, inputs: dict[str, float | None]) -> None:
        """The checkpoint interval's inputs (ckpt.interval.IntervalInputs.snapshot) after a change."""
        job = self.job
        for gauge, key in ((self.ckpt_cost, "cost_s"), (self.mtbf, "mtbf_s"), (self.restart_cost, "restart_s")):
            if inputs.get(key) is not None:
                gauge.labels(job).set(inputs[key])

    def on_checkpoint_interval(self, interval_s: float) -> None:
        """The interval between saves the plan targets, as soon as it is known (not only at a commit:
        a job that never commits must still be seen to be overdue)."""
        self.ckpt_interval.labels(self.job).set(interval_s)

    def on_resumed_commit(self, committed_at: float) -> None:
        """A resumed job: its last commit is the restored checkpoint's, not this process's start."""
        self.ckpt_last_commit.labels(self.job).set(committed_at)

    def on_checkpoint_failed(self) -> None:
        """A save will not commit because it failed: a rank's shard write failed, its shards do not
        tile every tensor, or the manifest commit failed twice."""
        self.ckpt_failures.labels(self.job).inc()

    def on_checkpoint_skipped(self, count: int = 1) -> None:
        """`count` saves will not commit although nothing failed in them: they were in flight when
        their generation ended (a failure, a shrink or a grow), or their step is committed already
        by the history a restore skipped (ckpt.commit.Committer.left_behind), or a newer complete save
        overtook them before their manifest create began (a store slower than the cadence: only the newest
        is created). A save requested while a rank's is in flight is never skipped: it waits (docs/design.md
        invariant 6)."""
        self.ckpt_skipped.labels(self.job).inc(count)

    def on_failure(self, kind: str) -> None:
        """A failure of `kind` (e.g. "actor_died", "hang", "nan") was detected."""
        self.failures.labels(self.job, kind).inc()

    def on_control_rejected(self, channel: str) -> None:
        """The controller or a rank dropped a control message on `channel`: someone without the
        job's secret wrote to the store. Called from the controller's thread."""
        self.control_rejected.labels(self.job, channel).inc()

    def on_control_missing(self, channel: str, n: int) -> None:
        """`n` queued messages on `channel` never arrived (orchestrator.wire.auth). Controller's thread."""
        self.control_missing.labels(self.job, channel).inc(n)

    def on_recovery(self, detection_s: float | None, recovery_s: float) -> None:
        """Training resumed after a failure detected `detection_s` after it happened (None: its onset is
        unknown, a crash no fault injected, which the detection series leaves out rather than read as 0)."""
        if detection_s is not None:
            self.detection.labels(self.job).observe(detection_s)
        self.recovery.labels(self.job).observe(recovery_s)

    def on_layout(self, generation: int, world_size: int, dp: int, tp: int, pp: int) -> None:
        """A generation formed with this layout; per-rank series of the old one are dropped."""
        job = self.job
        self.generation.labels(job).set(generation)
        self.world_size.labels(job).set(world_size)
        for dim, degree in zip(PARALLEL_DIMS, (dp, tp, pp), strict=True):
            self.parallel_degree.labels(job, dim).set(degree)
        # Ranks beyond a shrunk world would otherwise keep exporting their last value forever.
        self._compute_s.clear()
        self.rank_compute.clear()
        self.straggler.clear()
        self.straggler_ratio.clear()
        for rank in [r for r in self._snapshot_ranks if r >= world_size]:  # the others' stay until their next
            self.snapshot_host_bytes.remove(job, str(rank))
            self._snapshot_ranks.discard(rank)

    def on_state(self, state_name: str) -> None:
        """The controller entered `state_name`: it reads 1, every state seen before reads 0."""
        self._states.add(state_name)
        for state in self._states:
            self.controller_state.labels(self.job, state).set(1 if state == state_name else 0)

    def on_goodput(self, ledger: GoodputLedger) -> None:
        """Publish the ledger's reading, and from then on every change of it (GoodputLedger.watch): the
        controller calls it once the ledger is whole (a predecessor's totals carried), and again at
        times; scrapes count the open interval on to the scrape."""
        ledger.watch(self._goodput.publish)

    def on_rank_compute(self, rank: int, seconds: float) -> None:
        """A rank reported its step compute time (from its heartbeat)."""
        self._compute_s[rank] = seconds
        self.rank_compute.labels(self.job, str(rank)).set(seconds)

    def on_stragglers(self, flagged: set[int], ratios: Mapping[int, float] | None = None) -> None:
        """The straggler detector's current verdict for every rank that reported, and each rank's ratio
        to its peers where it has one (enough steps seen)."""
        for rank in self._compute_s:
            self.straggler.labels(self.job, str(rank)).set(1 if rank in flagged else 0)
        for rank, ratio in (ratios or {}).items():
            self.straggler_ratio.labels(self.job, str(rank)).set(ratio)
