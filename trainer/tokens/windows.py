"""Which window of which dataset feeds sample i of global step s: pure arithmetic, no state.

A prepared dataset of N tokens is cut into W = N // (T + 1) non-overlapping windows of T + 1
tokens (window w is tokens [w(T+1), (w+1)(T+1)); inputs are its first T tokens, labels its
last T). Global sample g = s * global_batch + i of a single dataset reads window
P_e(g mod W), with epoch e = g // W and P_e a keyed pseudorandom permutation of range(W):
every window once per epoch, in a fresh order each epoch, without replacement.

P_e is a four-round Feistel network over the smallest even number of bits covering W, with
cycle walking (a value that falls outside range(W) is permuted again until it lands inside):
a bijection computed in O(1) memory, so a corpus of a billion windows needs no permutation
table and any rank computes any sample without computing the ones before
(docs/design.md invariant 4).

A mixture deals the samples out like Bresenham's line: with shares w_0, w_1, ... (the
weights normalised), sample j goes to dataset 0 when floor((j+1) w_0 + d_0) > floor(j w_0 + d_0),
and then it is dataset 0's sample number floor(j w_0 + d_0) - floor(d_0), exactly; the
others are dealt among the remaining datasets the same way, with their shares renormalised.
So every run of n consecutive samples holds each dataset's share to within one sample per
level (independent draws would be off by O(sqrt n)), and each sample's index within its
dataset is known in O(1): dataset k's m-th sample reads its window P_e(m mod W_k), e = m // W_k,
so every window of every dataset is read once per epoch of that dataset. The seeded phases
d_k in [0, 1) keep different seeds from dealing alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.seeding import derive_seed

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a fast, well-mixed 64-bit integer hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


class KeyedPermutation:
    """A bijection of range(n) selected by `key`; `self(x)` is the image of x."""

    ROUNDS = 4

    def __init__(self, n: int, key: int):
        if n <= 0:
            raise ValueError(f"a permutation of {n} elements: need at least one")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [_mix(key + r * 0x9E3779B97F4A7C15 & _MASK64) for r in range(self.ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, x: int) -> int:
        if not 0 <= x < self.n:
            raise ValueError(f"{x} is outside range({self.n})")
        # The Feistel domain is at most 4n; walking the cycle returns to range(n) in < 4 steps on average.
        y = self._encrypt(x)
        while y >= self.n:
            y = self._encrypt(y)
        return y


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture: its number of windows and its weight (weights need not sum to 1)."""

    n_windows: int
    weight: float = 1.0


class WindowSchedule:
    """Sample (step, index) -> (dataset, window), for every rank alike; thread-safe (no shared
    state beyond a cache of permutations).

    Protocol: every rank builds one from the same seed, sources and global batch; the loader
    calls `window(step, index)` for the indices its place in the layout owns.
    """

    def __init__(self, sources: Sequence[Source], seed: int, global_batch: int):
        if not sources:
            raise ValueError("a window schedule needs at least one dataset")
        for k, source in enumerate(sources):
            if source.n_windows <= 0 or source.weight <= 0:
                raise ValueError(f"dataset {k}: {source.n_windows} windows, weight {source.weight}; both must "
                                 "be positive")
        self.sources, self.seed, self.global_batch = list(sources), seed, global_batch
        total = sum(s.weight for s in sources)
        # Share of dataset k among datasets k, k+1, ...: the dealing rule's w at level k.
        remaining, self.level_shares = 1.0, []
        for source in sources[:-1]:
            share = source.weight / total
            self.level_shares.append(min(1.0, share / remaining))
            remaining -= share
        self.phases = [derive_seed(seed, "mixture", k) / 2**63 for k in range(len(sources))]
        self._perms: dict[tuple[int, int], KeyedPermutation] = {}

    def deal(self, g: int) -> tuple[int, int]:
        """(dataset, its sample number) of global sample g (module docstring)."""
        j = g
        for k, (w, d) in enumerate(zip(self.level_shares, self.phases, strict=False)):
            before = math.floor(j * w + d)
            if math.floor((j + 1) * w + d) > before:
                return k, before - math.floor(d)
            j -= before - math.floor(d)
        return len(self.sources) - 1, j

    def _permutation(self, source: int, epoch: int) -> KeyedPermutation:
        key = (source, epoch)
        perm = self._perms.get(key)
        if perm is None:
            perm = KeyedPermutation(self.sources[source].n_windows, derive_seed(self.seed, "windows", source, epoch))
            if len(self._perms) > 64:  # a handful of live epochs; never grows without bound
                self._perms.clear()
            self._perms[key] = perm
        return perm

    def window(self, step: int, index: int) -> tuple[int, int]:
        """(dataset, window id) of sample `index` of global step `step`."""
        if step < 0 or not 0 <= index < self.global_batch:
            raise ValueError(f"sample {index} of step {step}: need step >= 0 and 0 <= index < {self.global_batch}")
        source, m = self.deal(step * self.global_batch + index)
        n = self.sources[source].n_windows
        return source, self._permutation(source, m // n)(m % n)
