"""An evaluation under ZeRO-2 gives the gathered parameters back: FSDP2 keeps them gathered after a
forward when `reshard_after_forward` is off, and only a backward reshards them, which an evaluation
never runs. Left gathered, every rank would hold the whole model through the checkpoint staging that
follows an evaluation."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from tests.dist._launch import run_ranks
from tests.dist.test_engine_3d import DATA, MODEL, TRAIN, par
from trainer.engine import Engine


def _evaluate(rank, world_size):
    engine = Engine(MODEL, DATA, TRAIN, par(dp=2, zero=2), rank=rank, world_size=world_size)
    engine.train_step()
    windows = [torch.randint(0, MODEL.vocab_size, (DATA.seq_len + 1,), generator=torch.Generator().manual_seed(i))
               for i in range(4)]
    loss, tokens = engine.evaluate(windows)
    sharded = all(isinstance(p, DTensor) for p in engine.model.parameters())
    engine.train_step()  # and training goes on from there
    return sharded, tokens


def test_an_evaluation_under_zero_2_leaves_the_parameters_sharded():
    for sharded, tokens in run_ranks(_evaluate, 2):
        assert tokens == 4 * DATA.seq_len and sharded
