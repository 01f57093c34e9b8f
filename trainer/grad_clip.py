"""The global gradient norm and clipping when gradients are sharded (TP, FSDP).

With whole, replicated gradients (DDP, ZeRO-1 at tp = 1) every rank computes the norm alone
(trainer.optim.clip_grad_norm). Otherwise each rank holds pieces: shards that differ between
ranks, and replicas that are the same on several (TP-replicated norm gains, DDP copies). Each
rank sums the squares of its pieces, each weighted by 1 / (number of ranks holding that
identical piece), and one all-reduce over the whole world gives the sum over the logical
gradients, every element counted once. Each piece's norm is fp32 (as torch's and Megatron's
are), its square and the weighted sum float64, which keeps the weighting's rounding far below
fp32's. Clipping then scales every local piece by the same factor, with torch's formula
(max_norm / (norm + 1e-6), at most 1).

Protocol: every rank calls `clip_sharded_grads` after the gradients are reduced, before the
optimizer step (collective over `group`, the default group when None).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from trainer.dtensor_slices import ParamLayout, local


def clip_sharded_grads(layouts: list[ParamLayout], max_norm: float | None, group=None) -> float:
    """Global L2 norm of the logical gradients before clipping; clips them to `max_norm` if set."""
    grads, parts = [], []
    for layout in layouts:
        if layout.param.grad is None:
            continue
        grad = local(layout.param.grad)
        grads.append(grad)
        if layout.copy:  # a tied embedding's pipeline copy: clipped, but counted once (its original)
            continue
        # Each tensor's norm by a reduction kernel (a float64 copy of a 128k x 4k embedding's gradient
        # would be gigabytes, just before the optimizer step), squared and weighted in float64.
        parts.append(torch.linalg.vector_norm(grad, dtype=torch.float32).double().square() / layout.geometry.replicas)
    # On the gradients' device: NCCL reduces device tensors only.
    device = layouts[0].param.device if layouts else None
    total = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(total, group=group)
    norm = math.sqrt(float(total))
    if max_norm is not None:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for grad in grads:
                grad.mul_(coef)
    return norm
