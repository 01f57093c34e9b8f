"""Steps of data loaded ahead by a background thread, for every data cursor.

Protocol: a cursor builds one `StepPrefetcher(load, steps)` and, on the training thread, calls
`get(key)` once per step, where `key = (step, *place)` (`place`: the rest of what `load`
needs, e.g. the batch sizes and this rank's place in the layout) and `load(key)` is a pure
function of the key. `get` returns the prefetched result for `key` (waiting for it if still
in flight) or loads it on the spot; then it asks the thread for steps step+1 .. step+`steps`
of the same place. A `get` for anything else (a restore, an elastic change of layout) drops
what was prefetched. At most `steps` results are held, so memory stays bounded whatever the
dataset's size. `close` cancels what is ahead; a cursor calls it when its engine is dropped.
While `get` waits for a step in flight it calls `on_wait(waited_s)` every `wait_tick_s` (when
set): a rank beats from there (orchestrator.rank.beats), so that the controller's hang watchdog
does not take an outage of the data store, which the reads wait out (trainer.tokens.reader), for a
hung rank.

Why a thread: the training thread's data wait is booked as `data` badput. A read from object
storage (the token loader's) mostly waits on the network, which then overlaps the step before;
the synthetic and text sources' samples are Python and numpy work, which runs while the training
thread is inside torch kernels or blocked in a collective (both release the GIL). On the 4-rank
CPU chaos job (dp 2 x pp 2, 1000 steps, two runs each, alternated) making the synthetic samples
ahead cut the data wait from 2.2 to 0.27 s and left the productive time even (132.7 against
133.5 s).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Generic, TypeVar

T = TypeVar("T")


WAIT_TICK_S = 1.0


def wait_reporting(future: Future, on_wait: Callable[[float], None] | None, tick_s: float = WAIT_TICK_S):
    """`future.result()`, calling `on_wait(waited_s)` every `tick_s` meanwhile (when given; it may
    raise to stop waiting). Not `result(timeout=)`: a load that raises TimeoutError itself would
    read as one more tick."""
    started = time.monotonic()
    while on_wait is not None and not futures_wait([future], timeout=tick_s).done:
        on_wait(time.monotonic() - started)
    return future.result()


class StepPrefetcher(Generic[T]):
    def __init__(self, load: Callable[[tuple], T], steps: int) -> None:
        if steps < 1:
            raise ValueError(f"data.prefetch_steps must be >= 1, got {steps}")
        self.load, self.steps = load, steps
        self.on_wait: Callable[[float], None] | None = None
        self.wait_tick_s = WAIT_TICK_S
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-prefetch")
        self._ahead: dict[tuple, Future] = {}
        self._lock = threading.Lock()

    def ahead(self) -> list[tuple]:
        """The keys prefetched or in flight (for tests and diagnostics)."""
        with self._lock:
            return list(self._ahead)

    def get(self, key: tuple) -> T:
        """`load(key)`, prefetched if it was; then prefetch the steps after it (module docstring)."""
        with self._lock:
            future = self._ahead.pop(key, None)
            if future is None:  # not the step we prefetched for: a restore or a new layout
                for other in self._ahead.values():
                    other.cancel()
                self._ahead.clear()
                if self.on_wait is not None:  # loaded by the thread too, so that the wait is reported
                    future = self._pool.submit(self.load, key)
        result = self._wait(future) if future is not None else self.load(key)
        step, place = key[0], key[1:]
        with self._lock:
            for ahead in range(step + 1, step + 1 + self.steps):
                nxt = (ahead, *place)
                if nxt not in self._ahead:
                    self._ahead[nxt] = self._pool.submit(self.load, nxt)
        return result

    def peek(self, key: tuple) -> T | None:
        """The result for `key` when it is ahead (waited for as `get` waits), left there for `get`;
        None when it is not ahead."""
        with self._lock:
            future = self._ahead.get(key)
        return None if future is None else self._wait(future)

    def _wait(self, future: Future) -> T:
        return wait_reporting(future, self.on_wait, self.wait_tick_s)

    def close(self, wait: bool = True) -> None:
        """Cancel the loads ahead; `wait` for the one in flight (a rank dropping its engine does not:
        a read stuck on a failing store must not hold up the restore)."""
        with self._lock:
            for future in self._ahead.values():
                future.cancel()
            self._ahead.clear()
        self._pool.shutdown(wait=wait, cancel_futures=True)


class ReadAheadCursor:
    """`microbatches` and `close` for a data cursor whose steps a StepPrefetcher makes ahead.

    A subclass holds `prefetch_steps`, `consumed` (a trainer.batch.SampleDigest) and `last_wait_s`,
    and defines `_load(key) -> (microbatches, sample ids)`, a pure function of key = (step,
    global_batch, micro_batch, dp_rank, dp_size). The prefetcher (and its thread) is made on the
    first recorded call, so a cursor used only for looks (`record=False`) starts none.
    """

    prefetcher: StepPrefetcher | None = None
    closed: threading.Event  # a subclass makes it (`close` sets it)
    # Set by the cursor's owner: `on_wait(waited_s)` while the training thread waits for a step in
    # flight (StepPrefetcher).
    on_wait: Callable[[float], None] | None = None

    def microbatches(self, step: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                     record: bool = True) -> list:
        """This rank's samples of `step` as microbatches, made ahead; starts on the steps after it.
        `record` False: a look that trains nothing (not counted, prefetch untouched: the step's
        result when it is ahead, else made on the spot)."""
        key = (step, global_batch, micro_batch, dp_rank, dp_size)
        if not record:  # a step ahead is looked at where it is: no second read, and its wait reported
            ahead = self.prefetcher.peek(key) if self.prefetcher is not None else None
            return (ahead if ahead is not None else self._load(key))[0]
        started = time.perf_counter()
        if self.prefetcher is None:
            self.prefetcher = StepPrefetcher(self._load, self.prefetch_steps)
        self.prefetcher.on_wait = self.on_wait
        batches, ids = self.prefetcher.get(key)
        self.last_wait_s = time.perf_counter() - started
        self.consumed.add(step, ids)
        return batches

    def close(self, wait: bool = True) -> None:
        """Stop making steps ahead (StepPrefetcher.close); the engine's owner calls it when it drops the engine.
        Sets `closed`, which a subclass's reads may watch: one retried on a failing store then gives
        up at its next wait instead of holding its thread and connections for the whole retry budget."""
        self.closed.set()
        if self.prefetcher is not None:
            self.prefetcher.close(wait)
