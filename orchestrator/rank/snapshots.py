"""A rank's side of the memory level: take snapshots, copy them to a buddy, restore from holders.

Protocol (docs/design.md, "Two levels"):
  * Training thread: `MemorySnapshots.take(step, slices, extra)` after a completed step the plan
    marks (`CheckpointPlan.snapshot_due`). The rank's state is staged (the only part training
    waits for) and written as an ordinary shard into this process's `HeldShards` by a
    background `ShardWriter`; the writer thread then sends the file to the buddy actor
    (`RankActor.hold_copy`), waits for its answer and pushes `SnapshotHeld` with both holders.
    The writer keeps one snapshot in flight, so a slow buddy delays the next snapshot, never
    training's current step.
  * Controller: commits the snapshot when every rank's `SnapshotHeld` is in, and on a failure
    may choose it: each rank's `restore` then gets a `MemorySource` and reads through
    `load_from_memory` (ckpt.peer_storage: own copies locally, the rest from live holders).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from ckpt.held import HeldShards
from ckpt.manifest import Manifest, ShardReceipt, step_dir
from ckpt.writer import ShardWriter
from orchestrator.wire.messages import SnapshotHeld

log = logging.getLogger(__name__)

# How long the writer thread waits for the buddy to take its copy before giving up on this
# snapshot (it then never completes; training goes on and the next one tries again).
BUDDY_TIMEOUT_S = 60.0
CHECK_S = 0.2  # how often a read from a holder asks whether its restore went stale


@dataclass
class MemorySource:
    """What a rank restores from when the controller chose the memory level (a Ray call argument)."""

    step: int
    manifest_json: str
    holders: dict[str, list[Any]] = field(default_factory=dict)  # shard file -> live holders' actor handles

    @property
    def files(self) -> list[str]:
        return [f"{step_dir(self.step)}/{file}" for file in self.holders]

    def manifest(self) -> Manifest:
        return Manifest.model_validate_json(self.manifest_json)

    @property
    def total_bytes(self) -> int:
        """The snapshot's size, which the restore's time limit is derived from (no storage manifest has it)."""
        return int(self.manifest().total_bytes)


def actor_id(handle) -> str:
    return handle._actor_id.hex()


def read_from_holder(holder, relpath: str, start: int, end: int, check: Callable[[], None] = lambda: None) -> bytes:
    """Bytes [start, end) of a shard `holder` keeps, within BUDDY_TIMEOUT_S. `check` runs every
    CHECK_S of the wait and raises when the restore reading has gone stale (restore_turns): a
    holder on a node being lost may answer only at the limit, and the next generation's restore
    waits for this one to give up its turn."""
    ref = holder.read_held.remote(relpath, start, end)
    deadline = time.monotonic() + BUDDY_TIMEOUT_S
    while not ray.wait([ref], timeout=max(0.0, min(CHECK_S, deadline - time.monotonic())))[0]:
        check()
        if time.monotonic() >= deadline:
            raise GetTimeoutError(f"the holder of {relpath} did not answer within {BUDDY_TIMEOUT_S:.0f} s")
    return ray.get(ref)


class MemorySnapshots:
    """One generation's memory snapshots of one rank (training thread: `take`; the rank loop flushes
    `writer` with its storage writer, ckpt.writers.flush_within)."""

    def __init__(self, held: HeldShards, rank: int, gen: int, tag: str, buddy, push):
        self.held, self.rank, self.gen, self.buddy, self.push = held, rank, gen, buddy, push
        me = ray.get_runtime_context().get_actor_id()
        self.holders = [me] if buddy is None else [me, actor_id(buddy)]
        self.writer = ShardWriter(held.storage, rank, self._held, self._failed, async_save=True, tag=tag)

    def take(self, step: int, slices, extra: dict) -> float:
        """Stage `slices` for the snapshot of completed step `step`; returns the seconds training waited."""
        return self.writer.save(step, slices, extra)

    def _held(self, receipt: ShardReceipt, extra: dict) -> None:
        """Writer thread: the shard is in this process; copy it to the buddy, then report."""
        relpath = f"{step_dir(receipt.step)}/{receipt.file}"
        if not self.held.note_written(relpath, self.gen):
            return  # this rank restored a later generation meanwhile: the snapshot can never complete
        if self.buddy is not None:
            copy = self.buddy.hold_copy.remote(relpath, self.held.read(relpath), self.gen)
            if not ray.get(copy, timeout=BUDDY_TIMEOUT_S):
                return  # the buddy restored a later generation: the same
        held_bytes = self.held.nbytes() + self.writer.staging.nbytes
        self.push(SnapshotHeld(receipt, list(self.holders), dict(extra, held_bytes=held_bytes)))

    def _failed(self, step: int, err: BaseException) -> None:
        # Not a storage save: nothing to abandon on the controller, the snapshot just never completes.
        log.warning("rank %d: memory snapshot of step %d not held twice: %s: %s", self.rank, step,
                    type(err).__name__, err)
