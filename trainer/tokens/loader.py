"""The streaming loader of prepared token datasets: each rank reads only its windows, ahead of time.

Protocol: the engine builds one `TokenCursor` per rank (through `trainer.data.make_cursor`)
and calls `microbatches(step, global_batch, micro_batch, dp_rank, dp_size)` once per step on
its training thread, as with the synthetic cursor. Sample i of step s is the window
`WindowSchedule.window(s, i)` (trainer/tokens/windows.py), a pure function of (seed, s, i), so
a resume in any layout neither skips nor repeats one. The reads go through a
trainer.prefetch.StepPrefetcher: the next `prefetch_steps` steps of the same place in the
layout are read ahead, and the loader's memory is bounded by
prefetch_steps x (global_batch / dp) x (seq_len + 1) x 8 bytes, whatever the dataset's size.

`last_wait_s` is how long the last call waited for data (the read, or the rest of a prefetch
in flight): the engine reports it and the controller books it as `data` badput. `consumed`
(a trainer.batch.SampleDigest of the (dataset, window) ids served) is the evidence for the
exactly-once check.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from trainer.batch import SampleDigest, collate, microbatches_per_rank, owned_indices
from trainer.prefetch import ReadAheadCursor
from trainer.tokens.reader import TokenDataset
from trainer.tokens.windows import Source, WindowSchedule


class TokenCursor(ReadAheadCursor):
    """Windows of one or more prepared datasets, as the engine's data cursor (see module docstring)."""

    def __init__(self, datasets: Sequence[TokenDataset], weights: Sequence[float], fields: Sequence[str],
                 seq_len: int, seed: int, prefetch_steps: int = 4, closed: threading.Event | None = None):
        """`fields`: the spec field of each dataset, for the errors; `closed`: the event `close` sets,
        which the datasets' read retries may watch (trainer.data.make_cursor makes both)."""
        self.closed = closed or threading.Event()
        self.datasets, self.weights = list(datasets), list(weights)
        self.seq_len, self.seed, self.prefetch_steps = seq_len, seed, prefetch_steps
        self.span = seq_len + 1
        for field, ds in zip(fields, self.datasets, strict=True):
            if len(ds) < self.span:
                raise ValueError(f"{field}={ds.url!r} holds {len(ds)} tokens, fewer than one window of data.seq_len"
                                 f" + 1 = {self.span}: use a larger dataset or a shorter seq_len")
        self.sources = [Source(len(ds) // self.span, w) for ds, w in zip(self.datasets, self.weights, strict=True)]
        self._schedules: dict[int, WindowSchedule] = {}
        self.last_wait_s = 0.0
        self.consumed = SampleDigest()

    @property
    def vocab_size(self) -> int:
        return max(ds.vocab_size for ds in self.datasets)

    def identity(self) -> dict:
        """What decides the window of each (step, index) besides data.seed: the window length and each
        dataset's weight and content (its shards' hashes, not its URL: a copied dataset is the same)."""
        parts = [{"weight": w, "tokens": ds.manifest.n_tokens, "shards": content_hash(ds)}
                 for ds, w in zip(self.datasets, self.weights, strict=True)]
        return {"source": "tokens", "seq_len": self.seq_len, "datasets": parts}

    def schedule(self, global_batch: int) -> WindowSchedule:
        sched = self._schedules.get(global_batch)
        if sched is None:
            sched = self._schedules[global_batch] = WindowSchedule(self.sources, self.seed, global_batch)
        return sched

    def sample_ids(self, step: int, global_batch: int, dp_rank: int, dp_size: int) -> range:
        """The global sample indices of `step` this dp rank owns: a contiguous block, as for every source."""
        return owned_indices(global_batch, dp_rank, dp_size)

    def sample_keys(self, step: int, global_batch: int, indices: Iterable[int] | None = None) -> list[tuple[int, int]]:
        """(dataset, window) of samples `indices` (default: all) of `step`, in index order."""
        sched = self.schedule(global_batch)
        return [sched.window(step, i) for i in (range(global_batch) if indices is None else indices)]

    def windows(self, step: int, global_batch: int, dp_rank: int, dp_size: int) -> list[tuple[int, int]]:
        """(dataset, window) of each sample this rank consumes at `step`, in index order."""
        return self.sample_keys(step, global_batch, self.sample_ids(step, global_batch, dp_rank, dp_size))

    def _load(self, key: tuple) -> tuple[list, list[tuple[int, int]]]:
        step, global_batch, micro_batch, dp_rank, dp_size = key
        count = microbatches_per_rank(global_batch, micro_batch, dp_size)
        ids = self.windows(step, global_batch, dp_rank, dp_size)
        samples: list = [None] * len(ids)
        # The datasets share one retry (trainer.data.make_cursor), whose budget is the step's, not each read's.
        with self.datasets[0].retry.one_outage():
            for source in sorted({s for s, _ in ids}):  # each dataset's windows of the step in one batch of reads
                mine = [i for i, (s, _) in enumerate(ids) if s == source]
                got = self.datasets[source].read_many([(ids[i][1] * self.span, self.span) for i in mine])
                for i, tokens in zip(mine, got, strict=True):
                    samples[i] = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        return [collate(samples[k * micro_batch:(k + 1) * micro_batch]) for k in range(count)], ids


def content_hash(ds: TokenDataset) -> str:
    """A short hash of a prepared dataset's token shards' SHA-256s, in order."""
    return hashlib.sha256("".join(s.tokens_sha256 for s in ds.manifest.shards).encode()).hexdigest()[:16]
