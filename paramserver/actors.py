"""The Ray actors of a parameter-server job: K servers and D workers, talking by actor calls.

Transport: Ray actor method calls; tensors travel pickled, through the object store when they
are large. A server is an asyncio actor, so a pull that the consistency bound holds back
(`ShardServer.may_read`) waits on a condition while the same actor keeps taking pushes; every
push wakes the waiting pulls. A worker actor runs a segment's loop in one call (`run`, a
streaming generator of step logs): per step it pulls from every server at once, computes, and
pushes to every server at once, waiting for the acknowledgements before the next pull (so a
server sees each worker's pushes in order, and its clock of a worker is that worker's next step).

Who calls what: the supervisor on the driver (paramserver.supervisor) creates the servers, then
the workers, calls every worker's `run` for a segment and reads the streams, polls each server's
`progress`, places injected kills with `hold` / `held` / `drop_held` (paramserver.gate), stops a
segment with `abort` and takes calls again after a restore with `reopen`, cuts a segment short at
an exact step with `freeze`, `cut` and `uncut` (paramserver.moves), asks where an actor runs with
`node`, probes a worker suspected of a hang with `pid` (paramserver.watchdog), stops one for an
injected hang with `hang`, and reads `stats` (the update records a batch at a time:
paramserver.update_history). Between segments it saves (`save_shard` on every server, through
paramserver.checkpoint.save_ps_checkpoint) and restores a replaced server (`load_shard`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import ray
import torch

from ckpt.config import DEFAULT_READ_RETRY_S
from ckpt.manifest import ShardReceipt
from paramserver import checkpoint
from paramserver.clocks import UpdateRecord
from paramserver.gate import PullDropped, PullGate, SegmentCut, SegmentStopped
from paramserver.messages import Pulled, Push
from paramserver.shard import ShardServer
from paramserver.update_history import RecordOutbox
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
    pid: int = -1  # the worker actor's process (a replaced worker's steps show its successor's)


@dataclass(frozen=True)
class ServerStats:
    server: int
    version: int
    bytes_in: int  # gradient payload pushed to it
    bytes_out: int  # parameter payload pulled from it
    records: list[UpdateRecord]  # the updates applied that the driver had not acknowledged
    batch: int = 0  # the newest batch of records (paramserver.update_history.RecordOutbox)


@dataclass(frozen=True)
class Progress:
    """What the supervisor polls from a server (paramserver.supervisor)."""

    server: int
    pid: int
    version: int
    clocks: list[int]  # per worker: steps pushed here


@ray.remote
class ServerActor:
    def __init__(self, *args, **kwargs):
        torch.set_num_threads(1)
        self.shard = ShardServer(*args, **kwargs)
        self._changed: asyncio.Condition | None = None
        self.gate = PullGate()
        self.outbox = RecordOutbox()
        self.stopped = False  # set by `abort`, until `reopen`
        self.frozen = False  # set by `freeze`, until `cut`: new pulls wait while the cut is chosen
        self.cut_at: int | None = None  # set by `cut`, until `uncut`: pulls of this step or later end the run
        self.answered = -1  # the highest step a pull was answered for

    def _condition(self) -> asyncio.Condition:
        # Made on first use, inside the actor's event loop.
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def pull(self, worker: int, step: int, rows: torch.Tensor | None) -> Pulled:
        self._check_cut(step)  # before the gate: no hold keeps a pull past a cut waiting
        try:
            await self.gate.wait(worker, step)
        except PullDropped:
            self._check_cut(step)  # dropped by the cut: the run ends cleanly; else the worker is dead
            raise
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: self.stopped or self._past_cut(step)
                                   or (not self.frozen and self.shard.may_read(step)))
            self._check_open()
            self._check_cut(step)
            self.answered = max(self.answered, step)
            return self.shard.pull(worker, step, rows)

    async def push(self, push: Push) -> None:
        changed = self._condition()
        async with changed:
            self._check_open()
            self.shard.push(push)
            changed.notify_all()

    def _check_open(self) -> None:
        if self.stopped:
            raise SegmentStopped(f"server {self.shard.index} stopped the segment: every server is being restored")

    def _past_cut(self, step: int) -> bool:
        return self.cut_at is not None and step >= self.cut_at

    def _check_cut(self, step: int) -> None:
        if self._past_cut(step):
            raise SegmentCut(f"server {self.shard.index}: the segment was cut at step {self.cut_at}")

    # ---- the supervisor's calls (paramserver.supervisor, paramserver.gate) ----

    async def hang(self) -> None:
        """chaos hang_server: this process stops, alive (SIGSTOP), until the hang watchdog kills it."""
        os.kill(os.getpid(), signal.SIGSTOP)

    async def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def progress(self) -> Progress:
        return Progress(self.shard.index, os.getpid(), self.shard.version, list(self.shard.clocks.pushed))

    async def hold(self, worker: int, step: int) -> None:
        if not self._past_cut(step):  # a hold past a cut is armed again in the next segment
            self.gate.hold(worker, step)

    async def held(self) -> list[tuple[int, int]]:
        return self.gate.held()

    async def drop_held(self, worker: int) -> None:
        self.gate.drop(worker)

    async def abort(self) -> None:
        """Stop the segment: waiting and later pulls and pushes raise SegmentStopped until `reopen`."""
        changed = self._condition()
        async with changed:
            self.stopped = True
            self.gate.drop()
            changed.notify_all()

    async def freeze(self) -> int:
        """Hold every pull not answered yet (the supervisor is choosing a cut); the highest step answered."""
        async with self._condition():
            self.frozen = True
            return self.answered

    async def cut(self, step: int) -> None:
        """End the segment at `step`: pulls of earlier steps are answered, pulls of `step` and later
        (held, waiting or to come) raise SegmentCut, so every worker stops with `step` pushed."""
        changed = self._condition()
        async with changed:
            self.cut_at, self.frozen = step, False
            self.gate.drop_from(step)
            changed.notify_all()

    async def uncut(self) -> None:
        """Take every pull again (the next segment starts at the cut)."""
        self.cut_at = None

    async def reopen(self, step: int) -> None:
        """After a restore to `step`: forget the update records of `step` and later (undone), and take
        calls again."""
        shard = self.shard
        shard.records = [r for r in shard.records if r.step < step]
        self.outbox.drop_from(step)
        shard.pending.clear()
        self.stopped, self.frozen, self.cut_at, self.answered = False, False, None, step - 1

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

    async def stats(self, acked: int = 0) -> ServerStats:
        """The counters, and the update records after batch `acked` (the driver has those); the
        shard's new records move to the outbox (paramserver.update_history)."""
        shard = self.shard
        new, shard.records = shard.records, []
        records = self.outbox.take(acked, new)
        return ServerStats(shard.index, shard.version, shard.bytes_in, shard.bytes_out, records, self.outbox.batch)


@ray.remote
class WorkerActor:
    def __init__(self, *args, **kwargs):
        torch.set_num_threads(1)
        self.worker = PSWorker(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def hang(self) -> None:
        """chaos hang_rank: this process stops, alive (SIGSTOP), until the hang watchdog kills it."""
        os.kill(os.getpid(), signal.SIGSTOP)

    def run(self, servers: list, start: int, steps: int, slow_s: float = 0.0):
        """Steps start..steps-1 against `servers` (handles in shard order), yielding each step's
        StepLog once its pushes are acknowledged: a streaming generator, so the driver has every
        finished step's log even when this actor dies later. `slow_s`: sleep this long per step
        after computing (a straggler, for the consistency comparison)."""
        worker = self.worker
        for step in range(start, steps):
            began = time.perf_counter()
            rows = worker.rows_needed(step)
            try:
                pulled = _settled([server.pull.remote(worker.index, step, rows) for server in servers])
            except SegmentCut:  # cut short here: every server has this worker's pushes up to `step`
                return
            pulled_at = time.perf_counter()
            for answer in pulled:
                worker.load(answer)
            loss_sum, tokens = worker.compute(step)
            if slow_s:
                time.sleep(slow_s)
            computed_at = time.perf_counter()
            pushes = worker.pushes(step, pulled, tokens)
            _settled([server.push.remote(push) for server, push in zip(servers, pushes, strict=True)])
            yield StepLog(worker.index, step, loss_sum, tokens, pulled_at - began, computed_at - pulled_at,
                          time.perf_counter() - computed_at, time.time(), os.getpid())


def _settled(refs: list) -> list:
    """ray.get once every call has finished, answered or failed: a worker whose step fails leaves
    no call in flight, so a server restored after its run ended sees nothing from before."""
    ray.wait(refs, num_returns=len(refs))
    return ray.get(refs)
