"""The synthetic source without its per-token Python loop: the same tokens as the loop, for every
seed, vocabulary and length, so checkpoints, parity tests and benchmarks see the same data."""

from __future__ import annotations

import math
import time

import pytest
import torch

from trainer.config import DataConfig
from trainer.data import SYNTHETIC_NOISE, DataCursor
from trainer.seeding import generator


def _loop_sample(cursor: DataCursor, step: int, index: int) -> torch.Tensor:
    """The implementation the vectorised one replaced, kept as the reference."""
    gen = generator(cursor.cfg.seed, step, index)
    seq_len = cursor.cfg.seq_len
    shortest = max(1, math.ceil(cursor.cfg.min_len_fraction * seq_len))
    n_tokens = int(torch.randint(shortest, seq_len + 1, (1,), generator=gen)) + 1
    noisy = (torch.rand(n_tokens, generator=gen) < SYNTHETIC_NOISE).tolist()
    random_tokens = torch.randint(0, cursor.vocab_size, (n_tokens,), generator=gen).tolist()
    tokens = [random_tokens[0]]
    for t in range(1, n_tokens):
        following = (cursor._mul * tokens[-1] + cursor._add) % cursor.vocab_size
        tokens.append(random_tokens[t] if noisy[t] else following)
    return torch.tensor(tokens, dtype=torch.long)


@pytest.mark.parametrize(("seed", "vocab", "seq_len", "min_len_fraction"), [
    (0, 256, 64, 0.5), (7, 1000, 128, 1.0), (3, 2, 16, 0.1), (11, 128256, 512, 0.5), (5, 50257, 2048, 0.9),
])
def test_the_vectorised_chain_yields_the_loop_s_tokens(seed, vocab, seq_len, min_len_fraction):
    cursor = DataCursor(DataConfig(seed=seed, seq_len=seq_len, min_len_fraction=min_len_fraction), vocab)
    for step, index in [(0, 0), (0, 1), (1, 0), (17, 5), (1000, 63)]:
        ours, reference = cursor.sample(step, index), _loop_sample(cursor, step, index)
        assert ours.dtype == torch.long and torch.equal(ours, reference), (step, index)


def test_the_chain_is_followed_between_restarts():
    cursor = DataCursor(DataConfig(seed=1, seq_len=256), 997)
    tokens = cursor.sample(3, 2).tolist()
    followed = sum(b == (cursor._mul * a + cursor._add) % 997 for a, b in zip(tokens, tokens[1:], strict=False))
    assert followed >= 0.8 * (len(tokens) - 1)  # about 1 - SYNTHETIC_NOISE of the steps follow the map


def test_a_long_sample_costs_no_python_loop():
    cursor = DataCursor(DataConfig(seed=0, seq_len=8192), 128256)
    started = time.perf_counter()
    for index in range(8):
        cursor.sample(0, index)
    vectorised = time.perf_counter() - started
    started = time.perf_counter()
    for index in range(8):
        _loop_sample(cursor, 0, index)
    loop = time.perf_counter() - started
    assert vectorised < loop, (vectorised, loop)
