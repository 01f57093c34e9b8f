"""Optimizer, learning-rate schedule and gradient clipping.

The schedule is a pure function of the step, so it has no state to checkpoint: the engine
sets each parameter group's lr from `lr_at(step)` before every optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from trainer.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (projections, embeddings) only; never on norm gains.

    Decaying a gain pulls the normalised activations towards zero, which is a change of
    the function, not a regulariser (as in GPT-2 and nanoGPT).
    """
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def fused_on(params: Iterable[torch.Tensor]) -> bool:
    """Whether AdamW runs fused: only where every parameter (a DTensor's local shard included)
    is on a CUDA device.

    Fused AdamW updates all tensors in one kernel per dtype: no launch per tensor and none of
    the foreach path's moment-sized temporaries. Elsewhere torch's default path stays, so the
    CPU parity tests keep the reference numerics they compare layouts against.
    """
    devices = [p.device.type for p in params]
    return bool(devices) and all(kind == "cuda" for kind in devices)


def keeps_step_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps AdamW's `step` on the parameter's device (fused or
    capturable: their kernels read it there) rather than on the CPU; a restore builds it there."""
    return any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay (Loshchilov & Hutter, arXiv:1711.05101), or SGD.

    AdamW is fused on CUDA (`fused_on`). SGD uses train.betas[0] as its momentum, so one knob
    means "first-moment decay" for both.
    """
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        # None, not False: torch's own choice of implementation off CUDA, as before.
        fused = True if fused_on(model.parameters()) else None
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.betas[0])


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based).

    Linear warm-up over the first `warmup_steps` steps (step 0 already trains, at lr/warmup),
    then a cosine from `lr` down to `min_lr_ratio * lr`, reached at step `steps`.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    min_lr = cfg.lr * cfg.min_lr_ratio
    decay_steps = cfg.steps - cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Global L2 norm of the gradients, measured before clipping; scales them to `max_norm` if above.

    The norm is always measured because the engine reports it. Parameters without a
    gradient are skipped. Every data-parallel rank holds identical gradients after the
    all-reduce, so every rank computes the same norm without further communication.
    """
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)
