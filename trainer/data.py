"""The global data cursor: sample i of global step s is a pure function of (seed, s, i).

A global step consumes `global_batch` samples, indexed 0..global_batch-1. A data-parallel
rank owns one contiguous block of those indices and cuts it into microbatches, so the
union over ranks is the same global batch whatever the layout (dp degree, microbatch size).
Nothing is stateful: the "cursor" is just the step number, which the engine checkpoints. A
run resumed in another layout therefore neither skips nor repeats a sample (docs/design.md
invariant 4).

Sources:
  synthetic  a noisy affine Markov chain over the vocabulary, x[t+1] = (a * x[t] + c) mod V
             with probability 1 - SYNTHETIC_NOISE and a uniform random token otherwise. The
             model can learn it, so the loss visibly falls from ln(V) towards the noise
             floor; sample lengths are drawn in [min_len_fraction * seq_len, seq_len] so
             microbatches are ragged and padding is exercised.
  text       a UTF-8 file read once (fsspec URL or path), one token per byte (vocab >= 256);
             each sample is a window of seq_len + 1 bytes at an offset hashed from (seed, s, i).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import fsspec
import torch

from trainer.config import DataConfig
from trainer.loss import IGNORE_INDEX
from trainer.seeding import derive_seed, generator

SYNTHETIC_NOISE = 0.1
BYTE_VOCAB = 256


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
    width = max(len(sample) for sample in samples) - 1
    input_ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample) - 1] = sample[:-1]
        labels[row, : len(sample) - 1] = sample[1:]
    return Batch(input_ids, labels)


def read_text_bytes(path: str) -> torch.Tensor:
    """The bytes of a UTF-8 text file as a uint8 tensor (read once, through fsspec)."""
    with fsspec.open(path, "rb") as handle:
        raw = handle.read()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"data.path={path!r} is not UTF-8 text ({err})") from err
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class DataCursor:
    """Deterministic samples of the job's data; safe to share between threads (no state).

    Every rank builds its own cursor from the same DataConfig and calls `microbatches` once
    per step with its place in the layout; no communication is needed.
    """

    def __init__(self, cfg: DataConfig, vocab_size: int):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self._text: torch.Tensor | None = None
        if cfg.source == "text":
            if vocab_size < BYTE_VOCAB:
                raise ValueError(
                    f"data.source='text' uses one token per byte and needs model.vocab_size >= "
                    f"{BYTE_VOCAB}, got {vocab_size}"
                )
            self._text = read_text_bytes(cfg.path)
            if len(self._text) < cfg.seq_len + 1:
                raise ValueError(
                    f"data.path={cfg.path!r} has {len(self._text)} bytes, fewer than "
                    f"data.seq_len + 1 = {cfg.seq_len + 1}: use a longer file or a shorter seq_len"
                )
        else:
            if vocab_size < 2:
                raise ValueError(f"synthetic data needs model.vocab_size >= 2, got {vocab_size}")
            rule = generator(cfg.seed, "synthetic-rule")
            # An odd multiplier makes the map a permutation when V is a power of two, so the
            # chain wanders over the whole vocabulary instead of collapsing into a short cycle.
            self._mul = int(torch.randint(0, vocab_size // 2, (1,), generator=rule)) * 2 + 1
            self._add = int(torch.randint(1, vocab_size, (1,), generator=rule))

    def sample(self, step: int, index: int) -> torch.Tensor:
        """Sample `index` of global step `step`: a 1-D int64 tensor of at most seq_len + 1 tokens."""
        if step < 0 or index < 0:
            raise ValueError(f"step and index must be >= 0, got step={step}, index={index}")
        if self._text is not None:
            span = self.cfg.seq_len + 1
            offset = derive_seed(self.cfg.seed, step, index) % (len(self._text) - span + 1)
            return self._text[offset : offset + span].long()
        return self._synthetic(generator(self.cfg.seed, step, index))

    def _synthetic(self, gen: torch.Generator) -> torch.Tensor:
        seq_len = self.cfg.seq_len
        shortest = max(1, math.ceil(self.cfg.min_len_fraction * seq_len))
        n_tokens = int(torch.randint(shortest, seq_len + 1, (1,), generator=gen)) + 1
        noisy = (torch.rand(n_tokens, generator=gen) < SYNTHETIC_NOISE).tolist()
        random_tokens = torch.randint(0, self.vocab_size, (n_tokens,), generator=gen).tolist()
        tokens = [random_tokens[0]]
        for t in range(1, n_tokens):
            following = (self._mul * tokens[-1] + self._add) % self.vocab_size
            tokens.append(random_tokens[t] if noisy[t] else following)
        return torch.tensor(tokens, dtype=torch.long)

    def sample_ids(self, step: int, global_batch: int, dp_rank: int, dp_size: int) -> range:
        """The global sample indices of `step` that data-parallel rank `dp_rank` owns.

        A contiguous block, so ranks in order concatenate to range(global_batch). The block
        does not depend on `step`; the argument keeps call sites explicit about time.
        """
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1}")
        if global_batch % dp_size:
            raise ValueError(
                f"train.global_batch={global_batch} is not divisible by parallel.dp={dp_size}"
            )
        per_rank = global_batch // dp_size
        return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)

    def microbatches(
        self, step: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int
    ) -> list[Batch]:
        """This rank's samples of `step`, in index order, cut into microbatches of `micro_batch`."""
        count = microbatches_per_rank(global_batch, micro_batch, dp_size)
        samples = [self.sample(step, i) for i in self.sample_ids(step, global_batch, dp_rank, dp_size)]
        return [collate(samples[k * micro_batch : (k + 1) * micro_batch]) for k in range(count)]
