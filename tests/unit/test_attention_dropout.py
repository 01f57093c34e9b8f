"""Attention dropout under tensor parallelism without sequence parallelism: the tp ranks' generators
agree, but each rank's heads are other heads, so a rank's salt gives its heads their own masks,
reproducibly, and leaves the shared generator where every rank's is (the replicated dropouts after
it still draw alike)."""

from __future__ import annotations

import torch

from trainer.config import ModelConfig
from trainer.model import CausalSelfAttention


def _attend(salt: int | None, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention output of fixed inputs after seeding the shared generator; and its next draw."""
    cfg = ModelConfig(vocab_size=32, n_layers=1, d_model=16, n_heads=2, dropout=0.5, max_seq_len=8)
    attn = CausalSelfAttention(cfg)
    attn.head_salt = salt
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=g) for _ in range(3))
    torch.manual_seed(seed)
    out = attn._attend(q, k, v)
    return out, torch.rand(4)


def test_each_tp_rank_s_heads_draw_their_own_masks_and_the_shared_generator_stays_in_step():
    rank0, after0 = _attend(0)
    rank1, after1 = _attend(1)
    again, _ = _attend(1)
    assert not torch.equal(rank0, rank1)  # the same heads' inputs, other masks: other ranks' heads
    assert torch.equal(rank1, again)  # reproducible (a recomputed forward replays it)
    assert torch.equal(after0, after1)  # the replicated dropouts after it still agree across ranks
    unsalted, _ = _attend(None)
    assert torch.equal(unsalted, _attend(None)[0]) and not torch.equal(unsalted, _attend(None, seed=8)[0])
