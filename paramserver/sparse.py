"""Lazy optimizer updates of selected rows (the sparse embedding path).

Semantics are lazy Adam, as torch.optim.SparseAdam has them (and TensorFlow's LazyAdam): only
the rows present in the gradient update their moments and their values; a row no worker
touched keeps its moments undecayed. The bias correction uses the tensor's own update count
(SparseAdam's `step`), which advances once per sparse update whatever rows it holds. Unlike
SparseAdam (no weight decay) the decoupled weight decay of AdamW (lr * wd * row) is applied to
the touched rows only, so an untouched row does not shrink. SGD with momentum is the same
lazily: only touched rows' momentum buffers decay, and its weight decay is torch.optim.SGD's L2
term (wd * row added to the gradient), on the touched rows.

This is not the dense optimizer's arithmetic (dense Adam decays every row's moments every
step), which is why bsp, whose contract is equality with collective data parallelism, always
updates densely (docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainer.config import TrainConfig

ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which the dense path uses


@dataclass
class RowState:
    """The optimizer state of one sparse slice: AdamW's exp_avg / exp_avg_sq / step, or SGD's
    momentum_buffer (named as trainer.state_slices names optimizer fields)."""

    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    step: int = 0


@torch.no_grad()
def lazy_update_(param: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, state: RowState,
                 cfg: TrainConfig, lr: float, weight_decay: float) -> None:
    """Update `param[rows]` (rows local to `param`, unique) with `grad` (len(rows) x row)."""
    if rows.numel() == 0:
        return
    values = param[rows]
    state.step += 1
    if cfg.optimizer == "sgd":
        if weight_decay:
            grad = grad.add(values, alpha=weight_decay)
        buf = state.fields.setdefault("momentum_buffer", torch.zeros_like(param))
        # torch.optim.SGD's first step stores the gradient itself as the buffer.
        moment = grad.clone() if state.step == 1 else buf[rows].mul_(cfg.betas[0]).add_(grad)
        buf[rows] = moment
        param[rows] = values - lr * moment
        return
    beta1, beta2 = cfg.betas
    exp_avg = state.fields.setdefault("exp_avg", torch.zeros_like(param))
    exp_avg_sq = state.fields.setdefault("exp_avg_sq", torch.zeros_like(param))
    m = exp_avg[rows].mul_(beta1).add_(grad, alpha=1 - beta1)
    v = exp_avg_sq[rows].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    exp_avg[rows], exp_avg_sq[rows] = m, v
    correction1 = 1 - beta1 ** state.step
    correction2 = 1 - beta2 ** state.step
    denom = (v.sqrt() / correction2 ** 0.5).add_(ADAM_EPS)
    values.mul_(1 - lr * weight_decay)
    values.addcdiv_(m, denom, value=-lr / correction1)
    param[rows] = values
