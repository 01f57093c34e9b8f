"""bf16 training on one GPU through the engine: throughput, peak memory, compile, resume.

Protocol: the main process calls these one after another on cuda:0, never concurrently (each
reads the device's peak-memory counters, which it resets first). Every run builds a fresh
`trainer.engine.Engine` at dp = tp = pp = 1 with `train.deterministic` left at the spec's
default (except the one run that flips it to measure what it costs), so the default path
(today: deterministic algorithms on, `CUBLAS_WORKSPACE_CONFIG` set by the engine) is the one
measured. The engine's optimizer is fused AdamW on CUDA (trainer/optim.py).

  train_run      warm-up steps, then timed steps: step time (each), tokens/s, losses, the peaks of
                 `torch.cuda.max_memory_reserved` and `max_memory_allocated` over the engine's
                 whole life (the first optimizer step, where the AdamW moments appear, included)
                 beside the cost model's four ledgers (trainer.costmodel.memory) for the same
                 workload, and the warm-up steps' times (a compile's among them).
                 `compile=True` sets `train.compile`: the engine compiles each transformer
                 block (trainer.compile, the path every compiled job takes); the compile
                 time falls in the untimed warm-up steps.
  resume_run     the same workload three ways: N steps straight; N - 1 steps, the state taken
                 out (`state_slices`, `state_meta`); a fresh engine restored from it that runs
                 step N. With deterministic algorithms on, every loss must be bitwise equal to
                 the straight run's (run-to-run determinism and exact resume, fused AdamW's
                 step counter included).
"""

from __future__ import annotations

import gc
import time

import torch

from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.costmodel.layout import Layout, Workload
from trainer.costmodel.memory import ledgers
from trainer.engine import Engine
from trainer.model import flops_per_token

COMPILE_VIA = "train.compile"


def configs(preset: str, seq_len: int, micro_batch: int, steps: int, recompute: str = "none",
            compile: bool = False, deterministic: bool | None = None,
            ) -> tuple[ModelConfig, DataConfig, TrainConfig, ParallelConfig]:
    """One GPU, one microbatch per step, fixed-length synthetic samples, bf16; `deterministic`
    (unless given) and every other field not named here at its default."""
    extra = {} if deterministic is None else {"deterministic": deterministic}
    train = TrainConfig(steps=steps, global_batch=micro_batch, micro_batch=micro_batch, precision="bf16",
                        compile=compile, **extra)
    return (ModelConfig(preset=preset), DataConfig(seq_len=seq_len, min_len_fraction=1.0), train,
            ParallelConfig(recompute=recompute))


def predicted_peak(model: ModelConfig, seq_len: int, micro_batch: int, recompute: str) -> dict:
    """The cost model's ledgers for the workload `train_run` measures, as JSON."""
    work = Workload(model=model, seq_len=seq_len, global_batch=micro_batch, precision="bf16")
    return ledgers(work, Layout(micro_batch=micro_batch, recompute=recompute), "gpu").to_json()


def _fresh_device(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _allocated(device: str) -> int:
    """Bytes allocated now on the device (0 off CUDA): what an earlier run left is not this run's."""
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def _reserved(device: str) -> int:
    """Bytes the caching allocator holds now (0 off CUDA), after `_fresh_device` emptied its cache."""
    return torch.cuda.memory_reserved() if device == "cuda" else 0


def _peaks(device: str) -> tuple[int, int]:
    """(max allocated, max reserved) bytes since the last reset; (0, 0) off CUDA (tests)."""
    if device != "cuda":
        return 0, 0
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _build(cfgs: tuple, device: str) -> Engine:
    model, data, train, parallel = cfgs
    return Engine(model, data, train, parallel, rank=0, world_size=1, device=device)


def train_run(preset: str, seq_len: int, micro_batch: int, steps: int, warmup: int, recompute: str = "none",
              compile: bool = False, device: str = "cuda", deterministic: bool | None = None) -> dict:
    """`warmup` untimed steps then `steps` timed ones; see the module docstring. `device` is
    "cuda" but for the unit tests, which run the same code on the CPU. `deterministic` set
    (to measure what the default costs or saves) also sets torch's process-wide switch for the
    run, which the engine only ever turns on, and puts it back afterwards."""
    cfgs = configs(preset, seq_len, micro_batch, warmup + steps, recompute, compile, deterministic)
    before = torch.are_deterministic_algorithms_enabled()
    if deterministic is not None:
        torch.use_deterministic_algorithms(deterministic)
    try:
        return _timed(cfgs, steps, warmup, device)
    finally:
        torch.use_deterministic_algorithms(before)


def _timed(cfgs: tuple, steps: int, warmup: int, device: str) -> dict:
    train = cfgs[2]
    _fresh_device(device)
    before = _allocated(device), _reserved(device)
    engine = None
    try:
        engine = _build(cfgs, device)
        return _measure(engine, cfgs, steps, warmup, device, before)
    finally:  # also after a failed build or compile: the next run must not find this one's memory held
        del engine
        if train.compile:  # its graphs and guards hold the blocks' parameters: the next run starts clean
            torch._dynamo.reset()
        _fresh_device(device)


def _measure(engine, cfgs: tuple, steps: int, warmup: int, device: str, before: tuple[int, int]) -> dict:
    model, data, train, parallel = cfgs
    losses, times, warm, tokens, data_wait = [], [], [], 0, 0.0
    for i in range(warmup + steps):
        _sync(device)
        started = time.perf_counter()
        result = engine.train_step()
        _sync(device)
        losses.append(result.loss)
        if i < warmup:  # a compile, the allocator's first growth: said, not averaged
            warm.append(time.perf_counter() - started)
            continue
        times.append(time.perf_counter() - started)
        tokens += result.tokens
        data_wait += result.data_wait_s
    allocated, reserved = _peaks(device)
    seq_len, micro_batch, recompute = data.seq_len, train.micro_batch, parallel.recompute
    return {
        "preset": model.preset, "seq_len": seq_len, "micro_batch": micro_batch, "recompute": recompute,
        "compile": train.compile, "compile_via": COMPILE_VIA if train.compile else None,
        "deterministic": train.deterministic, "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "fused_adamw": bool(engine.local_optimizer.defaults.get("fused")),
        "step_s": sum(times) / len(times), "tokens_per_s": tokens / sum(times), "data_wait_s": data_wait / len(times),
        "step_times": times, "warmup_s": warm,
        "flops_per_token": flops_per_token(model, seq_len), "losses": losses,
        "max_memory_allocated": allocated, "max_memory_reserved": reserved, "allocated_before": before[0],
        "reserved_before": before[1],
        "predicted": predicted_peak(model, seq_len, micro_batch, recompute),
    }


def resume_run(preset: str, seq_len: int, micro_batch: int, steps: int, device: str = "cuda") -> dict:
    """Losses of `steps` straight steps, of `steps - 1` steps, and of the step after a restore."""
    cfgs = configs(preset, seq_len, micro_batch, steps)
    straight = _build(cfgs, device)
    straight_losses = [straight.train_step().loss for _ in range(steps)]
    del straight
    first = _build(cfgs, device)
    first_losses = [first.train_step().loss for _ in range(steps - 1)]
    slices, meta = first.state_slices(), first.state_meta()
    del first
    restored = _build(cfgs, device)
    restored.load_slices(slices, meta)
    steps_on = {str(s["step"].device) for s in restored.local_optimizer.state.values() if "step" in s}
    resumed_loss = restored.train_step().loss
    fused = bool(restored.local_optimizer.defaults.get("fused"))
    deterministic_algorithms = torch.are_deterministic_algorithms_enabled()
    del restored
    _fresh_device(device)
    return {"preset": preset, "seq_len": seq_len, "micro_batch": micro_batch, "steps": steps,
            "deterministic": cfgs[2].deterministic, "deterministic_algorithms": deterministic_algorithms,
            "straight": straight_losses, "rerun": first_losses,
            "resumed": resumed_loss, "fused_adamw": fused, "restored_step_devices": sorted(steps_on)}
