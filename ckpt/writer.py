"""A rank's checkpoint writer: stage to host memory, write in the background, report a receipt.

Protocol (one instance per rank, driven by the rank's training thread only):
  1. `save(step, slices, extra)` at a checkpoint step, with the rank's `TensorSlice`s
     (`engine.state_slices()`). `ckpt.shards.slices_to_write` picks the ones this rank
     writes (each replicated slice by one replica, bytes spread evenly); the training loop
     is blocked only while those are copied to host memory (the "staging"); the shard is
     then written by a background thread. With `async_save` False nothing is staged: the
     thread writes the shard from the rank's own tensors while training waits for it.
  2. When the shard is durable, `on_receipt(receipt, extra)` is called (from the writer
     thread) so the rank can hand the receipt to the controller, which commits.
  3. `flush()` before the rank leaves, so a final save is never lost (`wait()` waits for the
     save in flight without stopping the writer thread).

At most one snapshot is staged per rank (docs/design.md invariant 6): a save requested while
the previous one is still being written waits for it; the wait is part of the blocking
time and is counted in `waited`. The staging buffers are kept from one save to the next
(`ckpt.staging.StagingPool`), which that wait makes safe: a buffer is refilled only after
the write that read it has finished.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence

from ckpt.blocks import BLOCK_BYTES
from ckpt.manifest import ShardReceipt
from ckpt.shards import slices_to_write, write_slices
from ckpt.staging import StagingPool
from ckpt.storage import Storage
from trainer.state_slices import TensorSlice

log = logging.getLogger(__name__)

WRITER_NICE = 10  # added to the writer thread's nice value: it runs on what CPU training leaves over


def yield_cpu_to_training() -> None:
    """Lower the calling thread's CPU priority by `WRITER_NICE` (Linux: nice is per thread).

    Called by the background writer thread on itself, first thing. The copy that training waits
    for is done by then; what is left (gathering tiles, checksums, I/O) is not on the training
    path, so the scheduler should give a core to the training thread, its data loader or
    another rank's staging before it. Threads the writer starts (the direct-I/O thread) inherit
    the value. A no-op where threads have no nice value of their own.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))


class SaveAbandoned(Exception):
    """Raised inside an abandoned save's writing (OneSaveInFlight.abandon): it ends there, reported to nobody."""


class OneSaveInFlight:
    """What every rank writer shares: at most one save in flight (docs/design.md invariant 6),
    and the signs of life of a save that the rank's caller is blocked on.

    `_take_turn(slices)` at the start of a save waits for the previous one (counted in `waited`)
    and splits `slices` into the geometry this rank holds and the slices it writes; the writer
    clears `_idle` when it hands a save over and sets it when that save is done.

    `written_bytes` counts the shard bytes the store has taken, over every save (whichever
    thread or process writes them). `on_wait`, when set, is called on the caller's thread about
    every `wait_tick_s` while that thread is blocked on a save: waiting for the one in flight
    (`_take_turn`, `wait`, `flush`, and a synchronous save's own write). The rank uses it to
    keep beating with these bytes, so that the controller tells a long save from a hang.
    """

    wait_tick_s = 1.0

    def __init__(self) -> None:
        self.waited = 0
        self.written_bytes = 0
        self.on_wait: Callable[[], None] | None = None
        self._idle = threading.Event()  # set while no save is being written
        self._idle.set()
        self.abandoned = False  # `abandon`: the save in flight stops, reported to nobody

    def abandon(self) -> None:
        """The rank left its generation while this writer's save still wrote (a straggler of
        `ckpt.writers.flush_within`): the save's receipts would reach a generation the controller
        has left, so it can never commit. Stop it as soon as the writer can, so that its staging (a
        full copy of the rank's state) is freed now, not whenever a stalled store answers, and does
        not pile up with each generation a stalled store ends. Subclasses stop their writing."""
        self.abandoned = True

    def _count(self, nbytes: int) -> None:
        """`nbytes` more taken by the store (from the thread or process that writes)."""
        self.written_bytes += nbytes

    def _report(self, step: int, err: BaseException) -> None:
        """`on_error(step, err)` from the thread that writes (or listens): a report that fails too (the
        rank's channel to the controller gone) is logged, and must not end that thread, or every later
        save would wait for a writer that is gone."""
        try:
            self.on_error(step, err)
        except Exception:  # noqa: BLE001 (logged with its traceback)
            log.exception("rank %d: the failure of the save of step %d could not be reported (%s: %s)",
                          self.rank, step, type(err).__name__, err)

    def _wait_idle(self) -> None:
        while not self._idle.wait(self.wait_tick_s if self.on_wait is not None else None):
            self.on_wait()

    def _take_turn(self, slices: Sequence[TensorSlice]) -> tuple[list[TensorSlice], list[TensorSlice]]:
        if not self._idle.is_set():
            self.waited += 1
            self._wait_idle()
        return [piece.with_tensor(None) for piece in slices], slices_to_write(slices)

    def wait(self) -> None:
        """Block until the save in flight, if any, has been written and its receipt handed over."""
        self._wait_idle()


class ShardWriter(OneSaveInFlight):
    def __init__(
        self, storage: Storage, rank: int,
        on_receipt: Callable[[ShardReceipt, dict], None],
        on_error: Callable[[int, BaseException], None],
        async_save: bool = True,
        fault_hook: Callable[[str, int], None] | None = None,
        block_bytes: int = BLOCK_BYTES,
        tag: str = "",
        staging: StagingPool | None = None,
    ):
        self.storage = storage
        self.rank = rank
        self.on_receipt = on_receipt
        self.on_error = on_error
        self.async_save = async_save
        self.fault_hook = fault_hook  # chaos points "during_stage" and "during_shard_write"
        self.block_bytes = block_bytes
        self.tag = tag  # in shard file names: see ckpt.shards.shard_file_name
        super().__init__()
        # Callers that run several writers one save at a time (the checkpoint bench) may share one pool.
        self.staging = staging if staging is not None else StagingPool()
        # The background writer: one long-lived thread fed through `_jobs`, started by the first
        # async save and stopped by `flush`. Not a thread per save: `Thread.start` waits until the
        # new thread has run, which on a busy machine costs the training thread a scheduler turn.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def save(self, step: int, slices: Sequence[TensorSlice], extra: dict) -> float:
        """Stage this rank's share of `slices` and start writing; return the seconds the caller was blocked."""
        started = time.perf_counter()
        held, mine = self._take_turn(slices)
        # Async: a contiguous copy of each slice (a plain memcpy: the least training waits for),
        # even of CPU tensors, since training goes on mutating the originals while the shard is
        # written; the writer thread gathers column tiles from it. Sync: training waits for the
        # write, which reads the live tensors.
        staged = self.staging.stage(mine) if self.async_save else mine
        if self.fault_hook is not None:
            self.fault_hook("during_stage", step)
        blocking_s = time.perf_counter() - started
        self._idle.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"ckpt-writer-r{self.rank}", daemon=True)
            self._thread.start()
        self._jobs.put((step, staged, held, extra, blocking_s, started))
        if not self.async_save:  # written by the writer thread too, while training waits (and ticks)
            self._wait_idle()
            return time.perf_counter() - started
        return blocking_s

    def _serve(self) -> None:
        """The writer thread: one save at a time, until `flush` sends None."""
        if self.async_save:  # a synchronous save is what training waits for: not below it
            yield_cpu_to_training()
        while (job := self._jobs.get()) is not None:
            try:
                self._write(*job)
            finally:
                self._idle.set()

    def _write(self, step: int, staged: list, held: list, extra: dict, blocking_s: float, started: float) -> None:
        try:
            if self.fault_hook is not None:
                self.fault_hook("during_shard_write", step)
            receipt = write_slices(self.storage, step, self.rank, staged, blocking_s, held=held,
                                   block_bytes=self.block_bytes, tag=self.tag,
                                   on_progress=self._progress)
            if not self.async_save:
                receipt.blocking_s = time.perf_counter() - started
            self._progress(0)  # abandoned while the store took its last bytes: no receipt either
            self.on_receipt(receipt, extra)
        except SaveAbandoned:
            log.info("rank %d: the save of step %d stopped: its generation is over", self.rank, step)
        except BaseException as err:  # reported, never raised into the writer thread's loop
            self._report(step, err)

    def _progress(self, nbytes: int) -> None:
        """After each piece the store took: counted, or the end of an abandoned save (its next piece
        is not written; its partial files are unfinished ones, collected with their step)."""
        if self.abandoned:
            raise SaveAbandoned(f"rank {self.rank}'s save was abandoned")
        self._count(nbytes)

    def flush(self) -> None:
        """`wait`, then stop the writer thread (a later save starts a new one). Before the rank leaves."""
        self._wait_idle()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
