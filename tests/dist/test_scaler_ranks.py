"""The fp16 loss scaler's overflow flag across ranks: one rank's inf skips the step everywhere, also
on a rank that holds no gradient (a pipeline stage or a shard with nothing to unscale), which must
still join the flag's all-reduce on its own device."""

from __future__ import annotations

import torch

from tests.dist._launch import run_ranks
from trainer.scaler import LossScaler


def _unscale(rank, world_size):
    scaler = LossScaler(scale=4.0)
    grads = [torch.tensor([1.0, float("inf")])] if rank == 0 else []  # rank 1 holds no gradient
    first = scaler.unscale_(grads, device=torch.device("cpu"))
    clean = [torch.tensor([8.0])] if rank == 0 else []
    second = scaler.unscale_(clean, device="cpu")
    return first, second, [g.tolist() for g in clean]


def test_an_overflow_on_one_rank_is_seen_by_a_rank_without_gradients():
    (first0, second0, clean0), (first1, second1, clean1) = run_ranks(_unscale, 2)
    assert first0 is first1 is True  # both skip the step
    assert second0 is second1 is False and clean0 == [[2.0]] and clean1 == []
