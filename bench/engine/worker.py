"""The rank side of bench.engine: train each layout of one world size in one launch of ranks.

Protocol: `bench/engine/main.py` calls `run_ranks(train_layouts, world, args=(job, layouts, steps, warmup, backend,
port))` once per world size. Every rank walks the same list of layouts in the same order; for each it builds an
`Engine`, runs `warmup + steps` steps in lockstep and returns, per layout, either a record of every step (loss,
tokens, step_s, compute_s, bubble) or the error the engine raised. Construction errors (`check_layout`) are raised
on every rank alike before any collective, so the ranks stay in step and go on to the next layout; an error that
strikes only some ranks mid-collective hangs the others, which `run_ranks`' timeout turns into a failure of the
whole launch (the caller then retries its layouts one launch each, to pin the error on one).

On a GPU (`backend="nccl"`) each rank swaps the gloo group `run_ranks` made for an NCCL group on `port` (on
`cuda:rank`), because the engine's DeviceMesh uses the default group and gloo cannot run every collective on CUDA
tensors; `run_ranks`' final barrier and teardown then run on that NCCL group.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine


def _join_nccl(rank: int, world: int, port: int) -> torch.device:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.destroy_process_group()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), device_id=device)
    return device


def cpu_matmul_peak(precision: str) -> float:
    """This process's measured matmul peak (FLOP/s) at its thread count: the CPU "peak" of MFU, taken the way
    the controller takes it (orchestrator.rank.device.peak_flops_per_rank)."""
    from trainer.costmodel.hardware import measure_cpu_matmul_flops

    return measure_cpu_matmul_flops(0.3, precision)


def _configs(job: dict, layout: dict) -> tuple:
    model = ModelConfig(**job["model"])
    data = DataConfig(seq_len=job["seq_len"], min_len_fraction=1.0)
    train = TrainConfig(steps=job["warmup"] + job["steps"], global_batch=job["global_batch"],
                        micro_batch=job["micro_batch"], precision=job["precision"],
                        deterministic=job["deterministic"])
    parallel = ParallelConfig(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], zero=layout["zero"],
                              schedule=layout["schedule"])
    return model, data, train, parallel


def _run_layout(rank: int, world: int, job: dict, layout: dict, device: torch.device) -> dict:
    model, data, train, parallel = _configs(job, layout)
    try:
        engine = Engine(model, data, train, parallel, rank=rank, world_size=world, device=device)
    except (ValueError, NotImplementedError, RuntimeError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    steps = []
    for _ in range(job["warmup"] + job["steps"]):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        result = engine.train_step()
        if device.type == "cuda":
            # step_s ends when the host returns; the GPU may still be working on the step
            torch.cuda.synchronize(device)
        steps.append({"loss": result.loss, "tokens": result.tokens, "step_s": time.perf_counter() - started,
                      "compute_s": result.compute_s, "bubble": getattr(result, "bubble", None)})
    del engine
    # Free this layout's engine (DDP sits in reference cycles) while its groups are alive, and let every rank
    # finish before the next layout's mesh is built.
    gc.collect()
    if world > 1:
        dist.barrier()
    return {"steps": steps}


def train_layouts(rank: int, world: int, job: dict, layouts: list[dict], backend: str, port: int) -> dict:
    """Run by `run_ranks` on every rank: each layout in turn (module docstring). Rank 0 of a world-1 launch
    also measures the CPU matmul peak first, with the same single thread every rank trains with."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = _join_nccl(rank, world, port)
    out = {"layouts": [_run_layout(rank, world, job, layout, device) for layout in layouts]}
    if backend == "gloo" and world == 1:
        out["cpu_peak_flops"] = cpu_matmul_peak(job["precision"])
    return out
