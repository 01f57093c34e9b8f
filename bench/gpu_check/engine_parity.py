"""The engine's own collectives at a world of W > 1: DDP and ZeRO-3 give the one-process result.

The raw collectives (bench.gpu_check.collectives) prove NCCL computes what it should; this
proves the engine drives it right: DDP's bucketed gradient all-reduce, FSDP2's all-gather and
reduce-scatter (ZeRO-3), the token-count and gradient-norm all-reduces, with gradient
accumulation (two microbatches per rank) and variable-length samples.

Protocol, on every rank of `collectives.worker`, in this order:
  1. `reference(world, device)` before the process group exists: a one-process engine over
     the same global batch (the figures every layout must reproduce);
  2. after the group is initialised, `layout_problem(name, rank, world, device, ref)` for each
     of LAYOUTS, collectively (every rank, same order): None, or what differed.
Judged: every step's loss within LOSS_RTOL of the reference, the logical parameters' sum of
squares after the last step within PARAM_RTOL, and for DDP every rank's replica bitwise equal
to rank 0's. The tiny preset in fp32 (the engine's parity tests' reference precision).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine

LAYOUTS = {"engine ddp": 0, "engine zero3": 3}  # name -> parallel.zero at dp = world
STEPS = 2
LOSS_RTOL = 1e-4
PARAM_RTOL = 1e-5


def _engine(world: int, parallel: ParallelConfig, rank: int, world_size: int, device: torch.device) -> Engine:
    train = TrainConfig(steps=STEPS, global_batch=2 * world, micro_batch=1)
    return Engine(ModelConfig(preset="tiny"), DataConfig(seq_len=64), train, parallel, rank=rank,
                  world_size=world_size, device=device)


def local_sum_of_squares(engine: Engine) -> torch.Tensor:
    """This rank's share of the logical parameters' sum of squares (float64, on the device):
    each held piece divided by how many ranks hold it, a pipeline's tied copy left out; summed
    over all ranks it is the whole model's."""
    parts = [layout.local.detach().double().square().sum() / layout.geometry.replicas
             for layout in engine.layouts if not layout.copy]
    return torch.stack(parts).sum()


def reference(world: int, device: torch.device) -> dict:
    engine = _engine(world, ParallelConfig(), 0, 1, device)
    losses = [engine.train_step().loss for _ in range(STEPS)]
    return {"losses": losses, "sum_of_squares": float(local_sum_of_squares(engine))}


def layout_problem(name: str, rank: int, world: int, device: torch.device, ref: dict) -> str | None:
    """Train the layout `name` at dp = world (collective); None if it reproduced `ref`."""
    engine = _engine(world, ParallelConfig(dp=world, zero=LAYOUTS[name]), rank, world, device)
    losses = [engine.train_step().loss for _ in range(STEPS)]
    mine = local_sum_of_squares(engine)
    every = torch.empty(world, dtype=torch.float64, device=mine.device)
    dist.all_gather_into_tensor(every, mine.reshape(1))
    del engine
    return compare(name, losses, every.cpu().tolist(), ref)


def compare(name: str, losses: list[float], shares: list[float], ref: dict) -> str | None:
    """Judge one rank's losses and every rank's share of the sum of squares against `ref`."""
    for step, (got, want) in enumerate(zip(losses, ref["losses"], strict=True)):
        if not abs(got - want) <= LOSS_RTOL * abs(want):
            return f"step {step} loss {got:.7f}, one process {want:.7f}"
    total, want = sum(shares), ref["sum_of_squares"]
    if not abs(total - want) <= PARAM_RTOL * abs(want):
        return f"parameters' sum of squares {total:.9g}, one process {want:.9g}"
    if LAYOUTS[name] == 0 and len(set(shares)) > 1:  # DDP: every replica the same, bit for bit
        return f"DDP replicas differ: per-rank sums of squares {shares}"
    return None
