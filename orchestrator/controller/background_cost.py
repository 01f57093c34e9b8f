"""What a save's background work costs the training loop, beyond the time it blocked it.

An async save blocks the ranks only while they stage their state; the rest (serialising the shard,
writing it to storage or sending it to a buddy) runs beside training and takes CPU, memory bandwidth
and, on a GPU host, PCIe from the steps that run meanwhile. Young's interval needs the whole cost
C of a save: with the blocking time alone, a level whose background work slows every step looks
free and is planned too often (measured: the memory level's steps ran 14% slower on a 2-core host).

Protocol (controller thread; owned by orchestrator.controller.checkpoints.Checkpoints): when a
save of step s completes (a storage commit, or a memory snapshot held twice) while the running
generation has reported steps up to d, `charge(s, steps, d)` marks steps s+1..d as overlapped by
background work and returns their time above the median of the steps no save overlapped (0 until
enough of those exist to say what a clean step costs). Step s itself holds the blocking time,
charged apart. d is the running generation's newest step, not the furthest ever reported: after a
rollback the lost generation's records past d are work already booked as lost, not steps this save
overlapped.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Protocol

# Below this many clean steps a median says little; the correction waits rather than guess.
MIN_CLEAN_STEPS = 5
# The clean steps whose median is the baseline: the newest ones, as the step time drifts.
BASELINE_WINDOW = 200
# How far back a baseline is looked for, and what `overlapped` remembers: with saves overlapping
# nearly every step (both levels, frequent snapshots) clean steps are rare, and an unbounded walk
# and set grow with the job (a walk to step 0 took 66 ms at 10^6 steps, per save).
LOOKBACK_STEPS = 20 * BASELINE_WINDOW


class _Step(Protocol):
    step_s: float


class BackgroundCost:
    def __init__(self) -> None:
        self.overlapped: set[int] = set()

    def charge(self, saved_step: int, steps: Mapping[int, _Step], newest: int) -> float:
        """Seconds the steps after `saved_step`, up to `newest` (the running generation's newest
        reported step), ran above a clean step."""
        if not steps:
            return 0.0
        window = [s for s in range(saved_step + 1, newest + 1) if s in steps]
        self.overlapped.update(window)
        self.overlapped.add(saved_step)  # it holds the blocking time: not a clean step either
        if len(self.overlapped) > 2 * LOOKBACK_STEPS:  # forget what no walk reaches any more
            self.overlapped = {s for s in self.overlapped if s > newest - LOOKBACK_STEPS}
        clean = self._newest_clean(steps, newest)
        if len(clean) < MIN_CLEAN_STEPS:
            return 0.0
        baseline = statistics.median(clean)
        return sum(max(0.0, steps[s].step_s - baseline) for s in window)

    def _newest_clean(self, steps: Mapping[int, _Step], newest: int) -> list[float]:
        """The times of the newest BASELINE_WINDOW clean steps among the LOOKBACK_STEPS before
        `newest`: a save's cost must not grow with the job's age (a sort of every step was, at
        20,000 steps, a good part of the controller's core)."""
        clean: list[float] = []
        for step in range(newest, max(-1, newest - LOOKBACK_STEPS), -1):
            if len(clean) == BASELINE_WINDOW:
                break
            if step in steps and step not in self.overlapped:
                clean.append(steps[step].step_s)
        return clean

    def on_restored(self, anchor: int | None) -> None:
        """A generation resumed after step `anchor`: the steps after it will be run (and timed) again."""
        self.overlapped = {s for s in self.overlapped if anchor is not None and s <= anchor}
