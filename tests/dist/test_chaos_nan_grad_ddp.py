"""nan_grad on one rank of a 2-rank DDP engine: that replica first, then every replica through the all-reduce."""

import math

import pytest
import torch

from chaos.injector import FaultInjector
from tests.dist._launch import run_ranks
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine

pytestmark = pytest.mark.dist


def poisoned_run(rank: int, world_size: int) -> list[tuple[bool, float]]:
    """Per step: (this rank's weights hold NaN afterwards, the step's reported loss)."""
    train = TrainConfig(steps=4, global_batch=4, micro_batch=2, lr=1e-3)
    engine = Engine(ModelConfig(preset="tiny"), DataConfig(seq_len=16), train, ParallelConfig(dp=world_size),
                    rank=rank, world_size=world_size)
    engine.fault_hook = FaultInjector.hook_for([{"id": 0, "kind": "nan_grad", "rank": 1, "at_step": 1}], rank,
                                               lambda event: None, target=engine.model)
    out = []
    for _ in range(3):
        result = engine.train_step()
        out.append((any(bool(torch.isnan(p).any()) for p in engine.model.parameters()), result.loss))
    return out


def test_nan_grad_poisons_its_rank_then_spreads_through_the_gradient_all_reduce():
    rank0, rank1 = run_ranks(poisoned_run, world_size=2)
    # Step 0 clean everywhere; step 1 poisons rank 1's update only (its gradients were already
    # reduced); at step 2 rank 1's NaN loss and gradients reach rank 0 through the collectives.
    assert [nan for nan, _ in rank0] == [False, False, True]
    assert [nan for nan, _ in rank1] == [False, True, True]
    assert math.isfinite(rank0[1][1]) and math.isfinite(rank1[1][1])
    assert math.isnan(rank0[2][1]) and math.isnan(rank1[2][1])
