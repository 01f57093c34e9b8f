"""Run a parameter-server job on the Ray cluster the caller connected to, and report it.

Called by the driver (`undying run` with parallel.mode ps, orchestrator/cli/ps_run.py; tests)
after `ray.init`. Builds the plan (paramserver.partition), K `ServerActor`s and D
`WorkerActor`s (one logical CPU each), runs every worker's loop to `train.steps`, collects the
servers' records and byte counters, and removes the actors. Not fault tolerant yet: an actor
that dies fails the job (docs/design.md, what is not built yet).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from paramserver.actors import ServerActor, ServerStats, StepLog, WorkerActor
from paramserver.clocks import UpdateRecord, format_histogram, staleness_histogram
from paramserver.partition import param_shapes, plan_shards, shard_bytes
from paramserver.worker import sparse_names
from trainer.batch import microbatches_per_rank
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.model import meta_model


@dataclass
class PSReport:
    consistency: str
    workers: int
    servers: int
    state_bytes: int  # S: the model's parameters, bytes
    shard_bytes: list[int]
    losses: list[float]  # per step: the token-weighted loss over every worker's share of that step
    wall_s: float
    steps: list[StepLog] = field(default_factory=list)
    stats: list[ServerStats] = field(default_factory=list)

    @property
    def records(self) -> list[UpdateRecord]:
        return [r for s in self.stats for r in s.records]

    def bytes_per_step(self) -> tuple[float, list[float]]:
        """Measured bytes moved per step (pushes + pulls): in total, and per server."""
        steps = max(1, len(self.losses))
        per_server = [(s.bytes_in + s.bytes_out) / steps for s in self.stats]
        return sum(per_server), per_server

    def summary(self) -> str:
        total, per_server = self.bytes_per_step()
        formula = 2 * self.workers * self.state_bytes
        hist = staleness_histogram(self.records)
        waits = sum(s.pull_wait_s for s in self.steps) / max(1, len(self.steps))
        lines = [
            f"parameter server: {self.consistency}, {self.workers} workers, {self.servers} servers, "
            f"{len(self.losses)} steps in {self.wall_s:.1f} s",
            f"loss: first {self.losses[0]:.4f}, last {self.losses[-1]:.4f}",
            f"bytes per step: {total / 1e6:.2f} MB moved (dense formula 2DS = {formula / 1e6:.2f} MB); "
            "per server " + ", ".join(f"{b / 1e6:.2f}" for b in per_server) + " MB",
            f"mean pull wait per step: {1e3 * waits:.1f} ms",
            f"staleness of {len(self.records)} updates (server version at apply - version pulled):",
            format_histogram(hist),
        ]
        return "\n".join(lines)


def step_losses(logs: list[StepLog]) -> list[float]:
    by_step: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
    for log in logs:
        by_step[log.step][0] += log.loss_sum
        by_step[log.step][1] += log.tokens
    return [by_step[s][0] / by_step[s][1] for s in sorted(by_step)]


def run_ps(model: ModelConfig, data: DataConfig, train: TrainConfig, parallel: ParallelConfig,
           *, slow: dict[int, float] | None = None, max_piece_bytes: int | None = None,
           on_stats: Callable[[list[ServerStats]], None] | None = None, stats_every_s: float = 1.0) -> PSReport:
    """Train `train.steps` steps in parameter-server mode; `slow`: {worker: seconds slept per step}.
    `on_stats` (monitor.ps_metrics.PSMetrics.on_server_stats) gets every server's cumulative stats
    about every `stats_every_s` while the workers run, and once at the end."""
    microbatches_per_rank(train.global_batch, train.micro_batch, parallel.dp)  # ValueError before any actor
    params = param_shapes(meta_model(model).named_parameters())
    shards = plan_shards(params, parallel.servers, max_piece_bytes)
    sparse = sparse_names(model, parallel.consistency)
    started = time.perf_counter()
    servers = [ServerActor.options(num_cpus=1).remote(k, shard, model, train, parallel.dp, parallel.consistency,
                                                      parallel.staleness, sparse)
               for k, shard in enumerate(shards)]
    workers = [WorkerActor.options(num_cpus=1).remote(w, parallel.dp, model, data, train, shards, sparse)
               for w in range(parallel.dp)]
    try:
        runs = [worker.run.remote(servers, 0, train.steps, (slow or {}).get(w, 0.0))
                for w, worker in enumerate(workers)]
        pending = list(runs)
        while on_stats is not None and pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=stats_every_s)
            on_stats(ray.get([server.stats.remote() for server in servers]))
        logs = [log for run in ray.get(runs) for log in run]
        stats = ray.get([server.stats.remote() for server in servers])
    finally:
        for actor in workers + servers:
            ray.kill(actor)
    return PSReport(parallel.consistency, parallel.dp, parallel.servers, sum(p.nbytes for p in params),
                    [shard_bytes(s) for s in shards], step_losses(logs), time.perf_counter() - started,
                    logs, stats)
