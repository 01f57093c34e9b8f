"""The Ray actors of a parameter-server job: K servers and D workers, talking by actor calls.

Transport: Ray actor method calls; tensors travel pickled, through the object store when they
are large. A server is an asyncio actor, so a pull that the consistency bound holds back
(`ShardServer.may_read`) waits on a condition while the same actor keeps taking pushes; every
push wakes the waiting pulls. A worker actor runs its whole loop in one call (`run`): per step
it pulls from every server at once, computes, and pushes to every server at once, waiting for
the acknowledgements before the next pull (so a server sees each worker's pushes in order).

Who calls what: the driver (paramserver.job) creates the servers, then the workers with the
servers' handles, calls every worker's `run` and waits for all of them, then each server's
`stats`. Between segments it saves (`save_shard` on every server, through
paramserver.checkpoint.save_ps_checkpoint) and restores a replaced server (`load_shard`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import ray
import torch

from ckpt.config import DEFAULT_READ_RETRY_S
from ckpt.manifest import ShardReceipt
from paramserver import checkpoint
from paramserver.clocks import UpdateRecord
from paramserver.messages import Pulled, Push
from paramserver.shard import ShardServer
from paramserver.worker import PSWorker


@dataclass(frozen=True)
class StepLog:
    """One worker's step, as its actor measured it."""

    worker: int
    step: int
    loss_sum: float
    tokens: int
    pull_wait_s: float  # from sending the pulls to having every answer (includes the bound's wait)
    compute_s: float
    push_s: float
    finished_at: float  # time.time() when the step's pushes were acknowledged


@dataclass(frozen=True)
class ServerStats:
    server: int
    version: int
    bytes_in: int  # gradient payload pushed to it
    bytes_out: int  # parameter payload pulled from it
    records: list[UpdateRecord]


@ray.remote
class ServerActor:
    def __init__(self, *args, **kwargs):
        torch.set_num_threads(1)
        self.shard = ShardServer(*args, **kwargs)
        self._changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        # Made on first use, inside the actor's event loop.
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def pull(self, worker: int, step: int, rows: torch.Tensor | None) -> Pulled:
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: self.shard.may_read(step))
            return self.shard.pull(worker, step, rows)

    async def push(self, push: Push) -> None:
        changed = self._condition()
        async with changed:
            self.shard.push(push)
            changed.notify_all()

    async def save_shard(self, root: str, step: int, storage_options: dict | None = None,
                         tag: str = "") -> ShardReceipt:
        """Write this shard's state at cut `step` as rank `index`'s shard file (paramserver.checkpoint;
        the driver commits). The copy is taken on the event loop, between pushes; the write runs
        off it, so the server keeps answering while its bytes go out."""
        slices = checkpoint.snapshot_shard(self.shard, step)
        return await asyncio.to_thread(checkpoint.write_shard, self.shard.index, slices, root, step,
                                       storage_options, tag)

    async def load_shard(self, root: str, step: int, storage_options: dict | None = None, *,
                         clock: int | None = None, read_retry_s: float = DEFAULT_READ_RETRY_S) -> int:
        """Restore this shard from committed checkpoint `step` (any PS or collective job of the model);
        the server's version. Called before any worker pulls from it again."""
        changed = self._condition()
        async with changed:
            version = checkpoint.load_shard(self.shard, root, step, storage_options, clock=clock,
                                            read_retry_s=read_retry_s)
            changed.notify_all()
        return version

    async def stats(self) -> ServerStats:
        shard = self.shard
        return ServerStats(shard.index, shard.version, shard.bytes_in, shard.bytes_out, list(shard.records))


@ray.remote
class WorkerActor:
    def __init__(self, *args, **kwargs):
        torch.set_num_threads(1)
        self.worker = PSWorker(*args, **kwargs)

    def run(self, servers: list, start: int, steps: int, slow_s: float = 0.0) -> list[StepLog]:
        """Steps start..steps-1 against `servers` (handles in shard order). `slow_s`: sleep this
        long per step after computing (a straggler, for the consistency comparison)."""
        worker, logs = self.worker, []
        for step in range(start, steps):
            began = time.perf_counter()
            rows = worker.rows_needed(step)
            pulled = ray.get([server.pull.remote(worker.index, step, rows) for server in servers])
            pulled_at = time.perf_counter()
            for answer in pulled:
                worker.load(answer)
            loss_sum, tokens = worker.compute(step)
            if slow_s:
                time.sleep(slow_s)
            computed_at = time.perf_counter()
            pushes = worker.pushes(step, pulled, tokens)
            ray.get([server.push.remote(push) for server, push in zip(servers, pushes, strict=True)])
            logs.append(StepLog(worker.index, step, loss_sum, tokens, pulled_at - began, computed_at - pulled_at,
                                time.perf_counter() - computed_at, time.time()))
        return logs
