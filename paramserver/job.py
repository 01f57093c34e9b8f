"""Run a parameter-server job on the Ray cluster the caller connected to, and report it.

Called by the driver (`undying run` with parallel.mode ps, orchestrator/cli/ps_run.py; tests;
bench/ps) after `ray.init`. Builds the plan (paramserver.partition) and hands the job to the
supervisor (paramserver.supervisor): K `ServerActor`s and D `WorkerActor`s (one logical CPU
each), run in segments between checkpoints, a dead worker replaced without a global restart, a
dead server restored with every other from the last checkpoint. Then takes the servers' last
records and byte counters (paramserver.update_history), removes the actors and stops the goodput
ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ckpt.storage_errors import DEFAULT_READ_RETRY_S
from paramserver.actors import ServerActor, ServerStats, StepLog, WorkerActor
from paramserver.clocks import UpdateRecord, format_histogram
from paramserver.hang_watch import HangLimits
from paramserver.job_inputs import Actors, Checkpoints
from paramserver.partition import param_shapes, plan_shards, shard_bytes
from paramserver.recovery import Failure, Fault, Ledger, NullLedger, steps_redone
from paramserver.restart_budget import RestartBudget
from paramserver.supervisor import Supervisor
from paramserver.update_history import UpdateHistory
from paramserver.worker import sparse_names
from trainer.batch import microbatches_per_rank
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.model import meta_model

log = logging.getLogger(__name__)


@dataclass
class PSReport:
    consistency: str
    workers: int
    servers: int
    state_bytes: int  # S: the model's parameters, bytes
    shard_bytes: list[int]
    losses: list[float]  # per step: the token-weighted loss over every worker's share of that step
    wall_s: float
    # The surviving execution of each (worker, step): every one, but for the oldest of a job past
    # step_logs.KEEP (in `losses` and `pull_wait` alone).
    steps: list[StepLog] = field(default_factory=list)
    history: UpdateHistory = field(default_factory=UpdateHistory)  # the update records, the servers' counters
    first_step: int = 0  # > 0 when the job resumed from its checkpoint
    failures: list[Failure] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)  # steps this run committed
    redone: int = 0  # (worker, step) executions thrown away by rollbacks
    goodput: dict[str, float] = field(default_factory=dict)  # ledger bucket -> seconds (they sum to wall_s)
    pids: dict[str, int] = field(default_factory=dict)  # every actor process the job started
    moves: list[str] = field(default_factory=list)  # actors moved off draining nodes (paramserver.moves)
    pull_wait: tuple[float, int] = (0.0, 0)  # seconds and worker steps of every surviving step's pull wait

    @property
    def records(self) -> list[UpdateRecord]:
        """The applied updates' records: every one, but for the oldest of a job past
        update_history.KEEP (counted in `staleness_histogram` alone)."""
        return self.history.kept

    def staleness_histogram(self) -> dict[int, int]:
        return self.history.staleness_histogram()

    def bytes_per_step(self) -> tuple[float, list[float]]:
        """Measured bytes moved per step run (pushes + pulls): in total, and per server. Over every actor a
        server had and every step this run executed, the steps a rollback threw away among them."""
        steps = max(1, len(self.losses) + self.redone / max(1, self.workers))  # (redone counts worker steps)
        per_server = [moved / steps for moved in self.history.bytes_moved().values()]
        return sum(per_server), per_server

    def summary(self) -> str:
        total, per_server = self.bytes_per_step()
        formula = 2 * self.workers * self.state_bytes
        hist = self.staleness_histogram()
        waits = self.pull_wait[0] / max(1, self.pull_wait[1])
        resumed = f" (resumed at step {self.first_step})" if self.first_step else ""
        lines = [
            f"parameter server: {self.consistency}, {self.workers} workers, {self.servers} servers, "
            f"{len(self.losses)} steps{resumed} in {self.wall_s:.1f} s",
            f"loss: first {self.losses[0]:.4f}, last {self.losses[-1]:.4f}" if self.losses else "loss: no step run",
            f"bytes per step: {total / 1e6:.2f} MB moved (dense formula 2DS = {formula / 1e6:.2f} MB); "
            "per server " + ", ".join(f"{b / 1e6:.2f}" for b in per_server) + " MB",
            f"mean pull wait per step: {1e3 * waits:.1f} ms",
            f"staleness of {self.history.updates} updates (server version at apply - version pulled):",
            format_histogram(hist),
            f"checkpoints committed at steps {self.checkpoints}" if self.checkpoints else "no checkpoint committed",
            *[f"failure: {f.line()}" for f in self.failures],
            *[f"drain: {line}" for line in self.moves],
        ]
        if self.goodput:
            productive = self.goodput.get("productive", 0.0)
            lines.append(f"goodput {productive / self.wall_s:.1%} of {self.wall_s:.1f} s: " + ", ".join(
                f"{bucket} {seconds:.2f} s" for bucket, seconds in self.goodput.items() if seconds > 0))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The report's JSON fields beside the losses (failures, pauses, ledger, checkpoints)."""
        return {"first_step": self.first_step, "failures": [f.to_dict() for f in self.failures],
                "pauses_s": [f.pause_s for f in self.failures if f.action == "replaced"],
                "steps_redone": steps_redone(self.failures), "checkpoints": self.checkpoints,
                "goodput": {**self.goodput, "clock_wall_s": self.wall_s}, "pids": self.pids, "moves": self.moves}


def run_ps(model: ModelConfig, data: DataConfig, train: TrainConfig, parallel: ParallelConfig,
           *, slow: dict[int, float] | None = None, max_piece_bytes: int | None = None,
           on_stats: Callable[[list[ServerStats]], None] | None = None, stats_every_s: float = 1.0,
           checkpoints: Checkpoints | None = None, faults: list[Fault] | tuple[Fault, ...] = (),
           ledger: Ledger | None = None, on_step: Callable[[StepLog], None] | None = None,
           hang: HangLimits | None = None, budget: RestartBudget | None = None,
           on_failure: Callable[[Failure], None] | None = None) -> PSReport:
    """Train to `train.steps` in parameter-server mode; `slow`: {worker: seconds slept per step}.
    `on_stats` (monitor.ps_metrics.PSMetrics.on_server_stats) gets every server's stats with the
    update records new since the last (paramserver.update_history) about every `stats_every_s`
    while the workers run, before each checkpoint, and once at the end.
    `checkpoints`: save every `every_steps` and restore from there (else one segment, and a dead
    server restarts the job's servers from the initial values); `faults`: injected kills;
    `ledger` (monitor.goodput.GoodputLedger, created when the job starts): booked, then stopped.
    `on_step` (orchestrator.cli.ps_run.step_feed: the pull waits and the job's step series) gets
    each worker step's log as the driver takes it (a step redone after a rollback again: both ran).
    `hang`: the hang watchdog's limits (paramserver.hang_watch), `budget` the repairs the job may make
    (paramserver.restart_budget); their defaults when None. `on_failure` (orchestrator.cli.ps_run.
    failure_feed) gets each failure (paramserver.recovery.Failure) as the supervisor books it."""
    microbatches_per_rank(train.global_batch, train.micro_batch, parallel.dp)  # ValueError before any actor
    params = param_shapes(meta_model(model).named_parameters())
    shards = plan_shards(params, parallel.servers, max_piece_bytes)
    sparse = sparse_names(model, parallel.consistency)
    ledger = ledger or NullLedger()
    # The transient failures a fine-tune's servers ride out reading model.from_hf's weights.
    read_retry_s = checkpoints.read_retry_s if checkpoints is not None else DEFAULT_READ_RETRY_S
    actors = Actors(
        lambda k: ServerActor.options(num_cpus=1).remote(k, shards[k], model, train, parallel.dp, parallel.consistency,
                                                         parallel.staleness, sparse, read_retry_s=read_retry_s),
        # A second concurrent call: `node` is answered while the worker is inside a segment's `run`.
        lambda w: WorkerActor.options(num_cpus=1, max_concurrency=2).remote(w, parallel.dp, model, data, train,
                                                                            shards, sparse),
        dict(slow or {}))
    supervisor = Supervisor(actors, parallel.servers, parallel.dp, train.steps, checkpoints=checkpoints,
                            faults=faults, ledger=ledger, on_stats=on_stats, stats_every_s=stats_every_s,
                            on_step=on_step, hang=hang, budget=budget, on_failure=on_failure)
    history = supervisor.history
    try:
        supervisor.run()
        if checkpoints is not None and checkpoints.preemption is not None:
            checkpoints.preemption.ending = True  # trained to the end: a signal now must not fail the finished job
        # A server that died after the final commit costs the report its last counts, not the finished
        # job (its records of the steps before the commit were taken before the save).
        if history.poll(supervisor.servers) is None:
            log.warning("a server did not answer for its final stats: the report carries the last ones read")
    finally:
        supervisor.teardown()
        ledger.stop()
    logs = supervisor.logs
    return PSReport(parallel.consistency, parallel.dp, parallel.servers, sum(p.nbytes for p in params),
                    [shard_bytes(s) for s in shards], logs.losses(), ledger.wall(), logs.kept(), history,
                    supervisor.start_step, supervisor.failures, supervisor.saved, supervisor.redone,
                    ledger.totals(), supervisor.pids, supervisor.moved, logs.pull_wait())
