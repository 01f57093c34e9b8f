"""The "in_allreduce" fault point on a 2-rank DDP engine: once per step, while the gradient all-reduce is
in flight, and an armed hook leaves every weight bit-identical to a run without one."""

import pytest
import torch

from tests.dist._launch import run_ranks
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine

pytestmark = pytest.mark.dist


def _engine(rank: int, world_size: int, micro_batch: int = 1) -> Engine:
    # global_batch 4 over dp 2 at micro_batch 1: two microbatches, only the last one all-reduces.
    train = TrainConfig(steps=4, global_batch=4, micro_batch=micro_batch, lr=1e-3)
    return Engine(ModelConfig(preset="tiny"), DataConfig(seq_len=16), train,
                  ParallelConfig(dp=world_size, ddp_bucket_mb=0.01), rank=rank, world_size=world_size)


def hooked_and_plain(rank: int, world_size: int) -> dict:
    """Three steps with a recording hook, three without: the points seen and whether the weights agree."""
    seen: list[tuple[str, int]] = []
    hooked = _engine(rank, world_size)
    hooked.fault_hook = lambda point, step: seen.append((point, step))
    buckets = []
    inner = hooked._clock.in_flight
    hooked._clock.in_flight = lambda: (buckets.append(1), inner())
    plain = _engine(rank, world_size)
    for _ in range(3):
        hooked.train_step()
        plain.train_step()
    same = all(torch.equal(a, b) for a, b in zip(hooked.model.parameters(), plain.model.parameters(), strict=True))
    return {"seen": seen, "buckets": len(buckets), "same": same}


def test_in_allreduce_fires_once_per_step_between_forward_and_backward_and_changes_no_bit():
    for out in run_ranks(hooked_and_plain, world_size=2):
        assert out["same"], "an armed fault hook changed the training numerics"
        assert out["buckets"] > 3, "the test wants several gradient buckets per step (small ddp_bucket_mb)"
        for step in range(3):
            points = [p for p, s in out["seen"] if s == step]
            assert points == ["before_step", "after_forward", "in_allreduce", "after_backward",
                              "after_optimizer_step"], points
