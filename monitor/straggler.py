"""Straggler detection from per-rank compute time.

Why compute time: a data-parallel all-reduce makes every rank wait for the slowest, so wall
step time is the same everywhere and cannot find the slow rank. Each rank measures its own
forward+backward time before the collectives that would hide it (the engine's `compute_s`)
and sends it with its heartbeat.

Rule: a rank is a straggler when the median of its recent compute times exceeds
`threshold` (1.10 = 10% slower) times the median of its peers' medians (peers: the ranks of
its `peer_group`; with pipeline parallelism the ranks of its stage, since stages of whole layers
and a head differ in work by design), at every
evaluation for `sustain_s` seconds. Medians and a sustain window keep a noisy machine (here:
many ranks sharing two cores) from flagging anyone in a clean run.

Protocol: the controller, single-threaded, calls `observe` for each heartbeat it reads and
`evaluate(now)` once per heartbeat period; `evaluate` returns the set of flagged ranks and
the ranks newly flagged since the previous call (for the log sentence and the eviction hook).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable


class StragglerDetector:
    def __init__(self, threshold: float = 1.10, window: int = 20, sustain_s: float = 10.0,
                 peer_group: Callable[[int], int] = lambda rank: 0):
        self.threshold = threshold
        self.window = window
        self.sustain_s = sustain_s
        self.peer_group = peer_group  # rank -> its group: compared only with the ranks of the same
        self.samples: dict[int, deque[float]] = {}
        self.slow_since: dict[int, float] = {}
        self.flagged: set[int] = set()
        self.last_ratios: dict[int, float] = {}  # `ratios()` as the last `evaluate` computed them

    def reset(self) -> None:
        """A new generation: ranks are renumbered, history no longer applies."""
        self.samples.clear()
        self.slow_since.clear()
        self.flagged.clear()
        self.last_ratios = {}

    def observe(self, rank: int, compute_s: float) -> None:
        self.samples.setdefault(rank, deque(maxlen=self.window)).append(compute_s)

    def ratios(self) -> dict[int, float]:
        """Each rank's median compute over the median of its peers' medians."""
        medians = {r: statistics.median(s) for r, s in self.samples.items() if len(s) >= 3}
        out = {}
        for rank, own in medians.items():
            group = self.peer_group(rank)
            peers = [m for r, m in medians.items() if r != rank and self.peer_group(r) == group]
            if peers and statistics.median(peers) > 0:
                out[rank] = own / statistics.median(peers)
        return out

    def evaluate(self, now: float) -> tuple[set[int], set[int]]:
        ratios = self.last_ratios = self.ratios()
        for rank, ratio in ratios.items():
            if ratio > self.threshold:
                self.slow_since.setdefault(rank, now)
            else:
                self.slow_since.pop(rank, None)
                self.flagged.discard(rank)
        newly = {r for r, since in self.slow_since.items()
                 if now - since >= self.sustain_s and r not in self.flagged}
        self.flagged |= newly
        return set(self.flagged), newly
