"""A rank's heartbeat key (`hb/<rank>`), written by its training thread only.

Protocol (one instance per `RankLoop.run`, on the training thread):
  1. `after_step(step, compute_s)` after every step: a beat at most every `monitor.heartbeat_s`
     with the mean compute time of the steps since the previous one (the straggler detector's
     input, orchestrator.controller.telemetry).
  2. `saving(step)` right before the rank asks its writers to save `step` (a synchronous save is
     written inside that call).
  3. `while_blocked()` is the writers' `on_wait` (ckpt.writer.OneSaveInFlight): called while the
     training thread waits on a save, or writes one inline, about once a `wait_tick_s`; it
     repeats the last beat with a fresh time, `saving` set and the bytes the writers have handed
     to the store. Without these beats a rank blocked on a long save (at a stop, at the final
     step, or behind a slow one still in flight) would look hung: no step for the hang limit.
  4. `while_reading(waited_s)` is the data cursor's `on_wait` (trainer.prefetch): called about
     once a second while the training thread waits for a step's data; it repeats the last beat
     with a fresh time and `data_wait_s`, so that an outage of the data store, which the reads
     wait out for up to `data.read_retry_s` (trainer.tokens.reader), is not taken for a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from orchestrator.wire.messages import Heartbeat
from orchestrator.wire.store import GenerationStore, heartbeat_key

log = logging.getLogger(__name__)


class Beats:
    def __init__(self, store: GenerationStore, rank: int, heartbeat_s: float, saved_bytes: Callable[[], int],
                 done_step: Callable[[], int] = lambda: -1):
        self.store, self.rank, self.heartbeat_s, self.saved_bytes = store, rank, heartbeat_s, saved_bytes
        self.done_step = done_step  # the last step this rank completed (before its first beat of the call)
        self.last: Heartbeat | None = None
        self._saving: int | None = None  # the step of this rank's newest save
        self._beat_at = -float("inf")  # time.monotonic() of the last beat
        self._compute, self._steps = 0.0, 0

    def after_step(self, step: int, compute_s: float) -> None:
        self._compute, self._steps = self._compute + compute_s, self._steps + 1
        now = time.monotonic()
        if now - self._beat_at >= self.heartbeat_s:
            self._write(Heartbeat(step, time.time(), self._compute / self._steps, saved_bytes=self.saved_bytes()))
            self._compute, self._steps, self._beat_at = 0.0, 0, now

    def saving(self, step: int) -> None:
        self._saving = step

    def while_blocked(self) -> None:
        if self.last is None or self._saving is None:
            return  # nothing trained yet in this call, or nothing saved: no save to wait on
        try:
            self._write(dataclasses.replace(self.last, time=time.time(), saving=self._saving,
                                            saved_bytes=self.saved_bytes(), data_wait_s=0.0))
        except Exception as err:  # a missed beat is no reason to leave the wait (the writer reads on)
            log.warning("rank %d: a heartbeat while waiting on a save failed (%s: %s)", self.rank,
                        type(err).__name__, err)

    def while_reading(self, waited_s: float) -> None:
        last = self.last or Heartbeat(self.done_step(), 0.0, 0.0)  # the call's first step waits too
        try:
            self._write(dataclasses.replace(last, time=time.time(), data_wait_s=waited_s))
        except Exception as err:  # a missed beat is no reason to leave the wait
            log.warning("rank %d: a heartbeat while waiting on a data read failed (%s: %s)", self.rank,
                        type(err).__name__, err)

    def _write(self, beat: Heartbeat) -> None:
        self.last = beat
        self.store.set_json(heartbeat_key(self.rank), beat.to_json())
