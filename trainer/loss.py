"""Token-weighted language-model loss.

The loss of a global batch is the mean over its *tokens*, not over its microbatches or
ranks: with S_r the summed cross-entropy and n_r the number of loss tokens on rank r (over
all of its microbatches),

    L = sum_r S_r / sum_r n_r

A mean of per-rank (or per-microbatch) means weights a token in a short microbatch more than
one in a long microbatch, so the loss and its gradient would change with the layout and the
padding. Every piece of the trainer therefore carries (sum, count) pairs and divides once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Label value of positions that carry no loss (padding); torch's cross_entropy default.
IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token cross-entropy of one microbatch and the number of tokens it covers.

    `logits` is (..., V), `labels` the matching (...) int64 with IGNORE_INDEX on padding.
    Returns (S, n): S a float32 scalar that autograd can differentiate, n an int64 scalar.
    Logits are upcast so that bf16 forwards still sum their loss in fp32.
    """
    loss_sum = F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (labels != IGNORE_INDEX).sum()


def token_weighted_mean(parts: Iterable[tuple[float | torch.Tensor, int | torch.Tensor]]) -> float:
    """sum(S) / sum(n) over (S, n) pairs from microbatches or ranks, in float64."""
    total_sum, total_tokens = 0.0, 0
    for loss_sum, n_tokens in parts:
        total_sum += float(loss_sum)
        total_tokens += int(n_tokens)
    if total_tokens == 0:
        raise ValueError("no loss tokens: every label is padding")
    return total_sum / total_tokens


def all_reduce_token_loss(loss_sum: float, n_tokens: int, group=None,
                          device: str | torch.device = "cpu") -> tuple[float, int]:
    """(sum_r S_r, sum_r n_r) over the ranks of `group`; every rank of the group must call it.

    One all-reduce of a float64 pair: float64 keeps token counts exact (to 2**53) and makes
    the reported loss independent of how the sum is split into ranks, to double rounding.
    `device` is where the group reduces (NCCL: the rank's GPU; gloo: the CPU).
    """
    pair = torch.tensor([loss_sum, float(n_tokens)], dtype=torch.float64, device=device)
    dist.all_reduce(pair, group=group)
    return float(pair[0]), int(pair[1])
