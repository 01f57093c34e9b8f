"""The parameter-server protocol in one process, without Ray: workers take turns, step by step.

The same `ShardServer` and `PSWorker` objects the actors wrap, driven round-robin (worker 0's
pull, compute and push for step s, then worker 1's, ...). Every consistency rule allows this
order (a worker pulls step s only after every worker pushed step s - 1), so it is a fast,
deterministic reference of the protocol's arithmetic: unit tests compare its bsp losses with
the engine's, and read its update records.
"""

from __future__ import annotations

from dataclasses import dataclass

from paramserver.clocks import UpdateRecord
from paramserver.partition import param_shapes, plan_shards
from paramserver.shard import ShardServer
from paramserver.worker import PSWorker, sparse_names
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.model import meta_model


@dataclass
class PSSetup:
    servers: list[ShardServer]
    workers: list[PSWorker]


def build_in_process(model: ModelConfig, data: DataConfig, train: TrainConfig, parallel: ParallelConfig,
                     max_piece_bytes: int | None = None) -> PSSetup:
    shards = plan_shards(param_shapes(meta_model(model).named_parameters()), parallel.servers, max_piece_bytes)
    sparse = sparse_names(model, parallel.consistency)
    servers = [ShardServer(k, shard, model, train, parallel.dp, parallel.consistency, parallel.staleness, sparse)
               for k, shard in enumerate(shards)]
    workers = [PSWorker(w, parallel.dp, model, data, train, shards, sparse) for w in range(parallel.dp)]
    return PSSetup(servers, workers)


def run_lockstep(setup: PSSetup, steps: int, start: int = 0) -> tuple[list[float], list[UpdateRecord]]:
    """Train steps start..steps-1; returns the token-weighted loss of each step over all workers
    and every server's update records."""
    losses = []
    for step in range(start, steps):
        loss_sum, tokens = 0.0, 0
        for w, worker in enumerate(setup.workers):
            rows = worker.rows_needed(step)
            pulled = [server.pull(w, step, rows) for server in setup.servers]
            for answer in pulled:
                worker.load(answer)
            part, n = worker.compute(step)
            for server, push in zip(setup.servers, worker.pushes(step, pulled, n), strict=True):
                server.push(push)
            loss_sum, tokens = loss_sum + part, tokens + n
        losses.append(loss_sum / tokens)
    return losses, [r for server in setup.servers for r in server.records]
