"""The rank-side checkpoint writer protocol, and which writer a job's config gets.

Two writers implement `CheckpointWriter`: `ckpt.writer.ShardWriter` (a background thread
of the rank) and `ckpt.process_writer.ProcessShardWriter` (a child process of the rank,
for object stores, whose clients hold the GIL for much of an upload). Both write the same
bytes by the same `ckpt.shards.write_slices`, and both keep at most one save in flight.

Protocol (one writer per rank and generation, driven by the rank's training thread):
  1. `make_writer(config, url, rank, ...)` when the rank starts training.
  2. `save(step, slices, extra)` at each checkpoint step: returns the seconds training was
     blocked (staging, or the whole write when saves are synchronous); the receipt reaches
     `on_receipt(receipt, extra)`, or a failed write `on_error(step, exc)`, from the
     writer's own thread.
  3. `wait()` blocks until the save in flight is durable; `flush()` does that and stops
     the writer, before the rank leaves the generation (`flush_within`: when it leaves on an
     abort, without waiting longer than a limit; `abandon()` then stops a save still writing,
     which can no longer commit: `abandon_stragglers`).
`waited` counts the saves that had to wait for the previous one (bounded memory: one
snapshot staged per rank). `written_bytes` counts the shard bytes the store has taken, and
`on_wait` (with `wait_tick_s`) is called while the driving thread is blocked on a save, so
that it can show the controller it is alive (ckpt.writer.OneSaveInFlight).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ckpt.config import CheckpointConfig
from ckpt.manifest import ShardReceipt
from ckpt.process_writer import STALL_S, ProcessShardWriter
from ckpt.storage import Storage
from ckpt.writer import ShardWriter
from trainer.state_slices import TensorSlice

OnReceipt = Callable[[ShardReceipt, dict], None]
OnError = Callable[[int, BaseException], None]
FaultHook = Callable[[str, int], None]
# Installs chaos storage faults on the Storage the writer uses; the second argument is where
# fault notices go. Called in the writer's own process (the child, for the process writer).
StorageSetup = Callable[[Storage, Callable[[dict], None]], None]


@runtime_checkable
class CheckpointWriter(Protocol):
    rank: int
    waited: int
    written_bytes: int
    on_wait: Callable[[], None] | None
    wait_tick_s: float

    def save(self, step: int, slices: Sequence[TensorSlice], extra: dict) -> float: ...

    def wait(self) -> None: ...

    def flush(self) -> None: ...

    def abandon(self) -> None: ...


def make_writer(config: CheckpointConfig, url: str, rank: int, on_receipt: OnReceipt, on_error: OnError, *,
                fault_hook: FaultHook | None = None, tag: str = "", storage_setup: StorageSetup | None = None,
                notify: Callable[[dict], None] | None = None, stall_s: float = STALL_S) -> CheckpointWriter:
    """The writer `config.writer` asks for (auto: a process on object stores when async, else the thread);
    `stall_s`: how long the process writer lets its store take no byte (ckpt.process_writer), on S3 only:
    elsewhere a shard's bytes reach the store in one call at its end, after all its progress."""
    if config.resolved_writer == "process":
        watched = url.startswith(("s3://", "s3a://"))
        return ProcessShardWriter(url, config.storage_options, rank, on_receipt, on_error, fault_hook=fault_hook,
                                  tag=tag, storage_setup=storage_setup, notify=notify,
                                  stall_s=stall_s if watched else math.inf)
    storage = Storage(url, config.storage_options)
    if storage_setup is not None:
        storage_setup(storage, notify or (lambda event: None))
    return ShardWriter(storage, rank, on_receipt, on_error, async_save=config.async_, fault_hook=fault_hook,
                       tag=tag)


def flush_within(writers: Sequence[CheckpointWriter], within_s: float | None) -> list[CheckpointWriter]:
    """Flush every writer; with `within_s`, wait no longer than that and return the writers still
    writing, whose flush goes on, on its own thread, to the end of their save (its staging freed
    then). A rank leaving on an abort must not wait out a slow store: such a save's receipts reach
    a generation the controller has left, so it never commits, and its files are unfinished ones."""
    if within_s is None:
        for writer in writers:
            writer.flush()
        return []
    flushing = []
    for writer in writers:
        writer.on_wait = None  # the rank has left: nobody beats for it
        thread = threading.Thread(target=writer.flush, name=f"ckpt-flush-r{writer.rank}", daemon=True)
        thread.start()
        flushing.append((writer, thread))
    deadline = time.monotonic() + within_s
    for _, thread in flushing:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [writer for writer, thread in flushing if thread.is_alive()]


def abandon_stragglers(writers: Sequence[CheckpointWriter], settle_s: float = 1.0) -> list[CheckpointWriter]:
    """A rank leaving its generation on an abort: its saves in flight get `settle_s` to land, then
    the ones still writing are abandoned (OneSaveInFlight.abandon), so that each stalled generation
    does not leave one more staged copy of the rank's state, and on object stores one more writer
    process, behind. Returns those."""
    stragglers = flush_within(writers, settle_s)
    for writer in stragglers:
        writer.abandon()
    return stragglers
