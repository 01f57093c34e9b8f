"""Microbatches and the evidence of which samples a rank consumed; shared by every data source.

`collate` turns samples (1-D token tensors of at most seq_len + 1 tokens) into a `Batch`;
`owned_indices` is the contiguous block of a global step's sample indices a dp rank owns (the
same rule for every source, so the union over ranks is the global batch in any layout).

`SampleDigest` is what a rank reports of the samples it consumed: a count and an
order-independent 64-bit sum of their ids' hashes (a multiset hash: a sample consumed twice
changes it, whatever the order). A sample's id is (dataset, window) for prepared datasets and
(0, global sample index) for the synthetic and text sources. The controller adds the dp
ranks' digests up and the exactly-once check compares them with the digest of the ids the
surviving steps should hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from trainer.loss import IGNORE_INDEX

_MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser: a fast, well-mixed 64-bit integer hash."""
    x &= _MASK64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class Batch:
    """One microbatch. input_ids and labels are (B, T) int64, right-padded to the longest sample;
    labels[b, t] is the token after input_ids[b, t], or IGNORE_INDEX on padding."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def n_tokens(self) -> int:
        """Number of positions that carry loss."""
        return int((self.labels != IGNORE_INDEX).sum())


def microbatches_per_rank(global_batch: int, micro_batch: int, dp_size: int) -> int:
    """Gradient-accumulation steps per optimizer step; ValueError when the batch does not split."""
    per_step = dp_size * micro_batch
    if global_batch % per_step:
        raise ValueError(
            f"train.global_batch={global_batch} is not divisible by parallel.dp ({dp_size}) x "
            f"train.micro_batch ({micro_batch}) = {per_step}: choose a global batch that is a "
            f"multiple of {per_step}, or change dp or micro_batch"
        )
    return global_batch // per_step


def collate(samples: list[torch.Tensor]) -> Batch:
    """Shift each sample into (inputs, labels) and right-pad them to the longest one."""
    # One padding call per tensor instead of two copies per row: this runs every step.
    input_ids = pad_sequence([sample[:-1] for sample in samples], batch_first=True, padding_value=0)
    labels = pad_sequence([sample[1:] for sample in samples], batch_first=True, padding_value=IGNORE_INDEX)
    return Batch(input_ids.long(), labels.long())


def owned_indices(global_batch: int, dp_rank: int, dp_size: int) -> range:
    """The global sample indices of a step that data-parallel rank `dp_rank` owns: a contiguous
    block, so ranks in order concatenate to range(global_batch)."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1}")
    if global_batch % dp_size:
        raise ValueError(f"train.global_batch={global_batch} is not divisible by parallel.dp={dp_size}")
    per_rank = global_batch // dp_size
    return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def sample_hash(source: int, sample: int) -> int:
    return mix64((source << 48) ^ sample ^ 0x5DEECE66D)


@dataclass
class SampleDigest:
    """(count, sum of sample hashes mod 2^64) of the samples of steps [first_step, end_step). A
    sample's hash holds the step that served it: a cursor that serves one step's samples at another
    (the next step's windows, the next epoch's order) gives another digest, not the same sum."""

    first_step: int = -1
    end_step: int = -1
    count: int = 0
    total: int = 0

    def add(self, step: int, ids: Iterable[tuple[int, int]]) -> None:
        """Count step `step`'s samples. A digest covers one run of consecutive steps: a step that
        does not follow the last one (served again, or out of order) starts a new run, whose
        `first_step` then tells the reader it covers less than a whole generation."""
        if step != self.end_step:
            self.first_step, self.end_step, self.count, self.total = step, step, 0, 0
        for source, sample in ids:
            self.count += 1
            self.total = (self.total + mix64(sample_hash(source, sample) ^ step)) & _MASK64
        self.end_step = step + 1

    def to_json(self) -> list[int]:
        return [self.first_step, self.end_step, self.count, self.total]

    @classmethod
    def of(cls, first_step: int, ids_per_step: Iterable[Iterable[tuple[int, int]]]) -> SampleDigest:
        digest = cls()
        for offset, ids in enumerate(ids_per_step):
            digest.add(first_step + offset, ids)
        return digest
