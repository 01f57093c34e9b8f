"""Dynamic loss scaling for fp16 training with fp32 master weights (Micikevicius et al. 2018,
arXiv:1710.03740).

fp16 has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by `scale`
before backward so the gradients land in fp16's range, and the fp32 gradients are divided by
it again before clipping and the optimizer step. If any gradient anywhere is inf or NaN the
scale was too large: the step is skipped (no update; the step counter still advances, as the
data cursor does), the scale halves and a line is logged. After `growth_interval`
consecutive clean steps the scale doubles, probing for the largest scale that fits. Overflows
that go on with the scale at its minimum are not a scale too large but a model whose gradients
fp16 cannot hold (divergence): after MAX_SKIPS_AT_MIN of them in a row `update` raises
LossScaleExhausted, instead of skipping every step from there on with the weights frozen while
the data and the schedule advance.

Protocol (the engine, every rank, once per step, after the last backward):
    found = scaler.unscale_(grads, group)   # collective: MAX all-reduce of the found-inf flag
    if not found: clip, optimizer.step()
    scaler.update(found, step)
All ranks see the same flag, so their scales never diverge. `state()` / `load_state()` carry
(scale, growth counter, skipped count) through the checkpoint's meta.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

INITIAL_SCALE = 2.0**16
GROWTH_INTERVAL = 2000
MAX_SKIPS_AT_MIN = 8


class LossScaleExhausted(FloatingPointError):
    """fp16 overflowed MAX_SKIPS_AT_MIN steps in a row with the loss scale at its minimum."""


class LossScaler:
    def __init__(self, scale: float = INITIAL_SCALE, growth_interval: int = GROWTH_INTERVAL,
                 min_scale: float = 1.0):
        if scale <= 0 or growth_interval < 1:
            raise ValueError(f"loss scale {scale} must be > 0 and growth_interval {growth_interval} >= 1")
        self.scale = float(scale)
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0  # consecutive steps without overflow since the last change of scale
        self.skipped = 0  # steps skipped for overflow over the whole run
        self.skipped_at_min = 0  # consecutive overflows with the scale already at min_scale

    def unscale_(self, grads: list[torch.Tensor], group=None, device: torch.device | str | None = None) -> bool:
        """Divide the local gradients by the scale in place; True if any rank found inf/NaN.

        Collective over `group` (the whole world: every rank must skip together) when a
        process group is initialised. `device`: the rank's, where the flag is reduced (NCCL
        reduces device tensors only), also when this rank holds no gradient; default: the
        gradients', else the CPU.
        """
        inverse = 1.0 / self.scale
        found = torch.zeros((), dtype=torch.float32, device=device or (grads[0].device if grads else "cpu"))
        for grad in grads:
            grad.mul_(inverse)
            found = torch.maximum(found, (~torch.isfinite(grad)).any().float())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found)

    def update(self, found_inf: bool, step: int) -> None:
        if found_inf:
            old = self.scale
            self.skipped_at_min = self.skipped_at_min + 1 if old <= self.min_scale else 0
            if self.skipped_at_min >= MAX_SKIPS_AT_MIN:
                raise LossScaleExhausted(
                    f"fp16 overflow at step {step} with the loss scale at its minimum ({self.min_scale:g}), "
                    f"{self.skipped_at_min} steps in a row: the gradients do not fit fp16 at any scale (the model "
                    "diverges); lower train.lr, lengthen train.warmup_steps, or train in bf16")
            self.scale = max(self.min_scale, self.scale / 2)
            self.clean_steps = 0
            self.skipped += 1
            log.warning("fp16 overflow at step %d: step skipped, loss scale %g -> %g (%d skipped so far)",
                        step, old, self.scale, self.skipped)
            return
        self.clean_steps += 1
        self.skipped_at_min = 0
        if self.clean_steps >= self.growth_interval:
            self.scale *= 2
            self.clean_steps = 0

    def state(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped,
                "skipped_at_min": self.skipped_at_min}

    def load_state(self, state: dict) -> None:
        scale = float(state["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scale {scale!r} in the checkpoint is not a positive number")
        self.scale, self.clean_steps, self.skipped = scale, int(state["clean_steps"]), int(state["skipped"])
        self.skipped_at_min = int(state.get("skipped_at_min", 0))  # (not in a checkpoint of an older release)
