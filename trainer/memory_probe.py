"""Measure a rank's memory by ledger, for comparison with the cost model's prediction.

The four ledgers of docs/design.md section 1, measured rather than predicted:
  * state: bytes of parameters, gradients and optimizer state actually allocated;
  * activation: bytes autograd saves for backward during one microbatch's forward, counted
    with `saved_tensors_hooks` (unique storages, so views are not double-counted);
  * collective: DDP's gradient bucket buffers, as DDP reports their sizes;
  * transient: the rest of the process's peak memory growth since the engine was built
    (workspaces, allocator slack): peak RSS on CPU, peak allocated on CUDA.

Protocol: a rank takes `current_bytes()` and calls `reset_peak_bytes()` before it builds an engine,
then `measure(engine, baseline_bytes)` once per generation, after its first
training step (so gradients and optimizer state exist); `baseline_bytes` is `current_bytes()`
taken before the engine was built. The probe runs one extra forward and backward of one
microbatch under `no_sync` and drops the gradients it made, so training state is unchanged.
`held_state_bytes(engine)` counts the state ledger alone, on any layout and without any
collective; called from the engine's "after_backward" fault point it sees the gradients.
"""

from __future__ import annotations

import contextlib
import math
import resource

import torch

from trainer.dtensor_slices import local
from trainer.loss import token_loss_sum


def current_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak_bytes(device: torch.device) -> None:
    """Start the peak `measure` reads afresh (CUDA's allocator keeps one since its last reset; a
    process's peak RSS cannot be reset, so on the CPU it stays the process's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shards) not in `seen`.

    Storages, not tensor sizes: an FSDP2 shard is a view into its padded flat shard (the
    padding is held too), and FSDP2's sharded gradients are views into one reduce-scatter
    output per unit, counted once. A storage freed by resizing to 0 counts nothing.
    """
    total = 0
    for tensor in tensors:
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def fsdp_params(model: torch.nn.Module) -> list:
    """FSDP2's per-parameter records (FSDPParam) of every unit in `model`."""
    out = []
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        for group in getattr(state, "_fsdp_param_groups", ()):
            out.extend(group.fsdp_params)
    return out


def state_tensors(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(master parameters, gradients) of `model` wherever FSDP2 keeps them at this moment.

    A unit's registered parameters are its sharded ones between uses and its gathered
    (unsharded) ones while it runs, and inside a pipeline from a backward to the step's
    reduction: the gathered copies are collective memory, so the sharded ones are counted
    in their place. A unit whose backward ran without reducing (`set_requires_gradient_sync
    (False)`, which torch's pipeline stages set for every backward before the step's
    reduction) holds each parameter's unsharded gradient on the gathered parameter or, under
    a low-precision policy, upcast to the reduce dtype (`unsharded_accumulated_grad`).
    FSDP2 exposes neither, hence its private fields.
    """
    records = fsdp_params(model)
    gathered = {id(r._unsharded_param) for r in records if hasattr(r, "_unsharded_param")}
    params = [p for p in model.parameters() if id(p) not in gathered] + [r.sharded_param for r in records]
    grads = [p.grad for p in params if p.grad is not None]
    for record in records:
        unsharded = getattr(record, "_unsharded_param", None)
        grads.extend(g for g in (getattr(unsharded, "grad", None), record.unsharded_accumulated_grad) if g is not None)
    return params, grads


def held_state_bytes(engine) -> dict[str, int]:
    """The state ledger as this rank holds it, by kind: parameters (the fp32 master weights:
    the engine computes in low precision through autocast or FSDP2's policy, never from a
    second stored copy), gradients (present between backward and the optimizer step; FSDP2's
    unsharded ones too: `state_tensors`),
    optimizer state (ZeRO-1: this rank's partition only) and the loss scaler's tensors.

    Local and collective-free, on every layout: pipeline ranks count their own chunks,
    the tied embedding's second copy included (trainer.engine_pipeline.LocalChunks).
    """
    seen: set[int] = set()
    params, grads = state_tensors(engine.model)
    held = {"params": _storage_bytes(params, seen), "grads": _storage_bytes(grads, seen)}
    optim_state = engine.local_optimizer.state.values()
    held["optimizer"] = _storage_bytes((v for fields in optim_state for v in fields.values()
                                        if torch.is_tensor(v)), seen)
    scaler = vars(engine.scaler).values() if engine.scaler is not None else ()
    held["scaler"] = _storage_bytes((v for v in scaler if torch.is_tensor(v)), seen)
    return held


def _probe_microbatch(engine) -> tuple[int, int]:
    """(activation bytes saved for backward, gradient bytes) of one microbatch.

    Runs forward and backward of one microbatch locally (`no_sync`: no collective, so only
    the calling rank needs to run it), then drops the gradients again: the engine clears
    gradients after every optimizer step, so its state is exactly as before.
    """
    # record=False: a probe is not training; the samples it looks at are not consumed.
    batch = engine.data.microbatches(engine.next_step, engine.train_config.global_batch,
                                     engine.train_config.micro_batch, engine.dp_rank, engine.dp_size,
                                     record=False)[0]
    storages: dict[int, int] = {}
    # Autograd also saves weights (for the input gradient of a matmul): those are state.
    weights = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    module = engine._ddp if engine._ddp is not None else engine.model
    sync = engine._ddp.no_sync() if engine._ddp is not None else contextlib.nullcontext()
    with sync:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), engine._autocast():
            logits = module(batch.input_ids.to(engine.device))
            loss_sum, _ = token_loss_sum(logits, batch.labels.to(engine.device))
        loss_sum.backward()
    params = list(engine.model.parameters())
    grads = _tensor_bytes(p.grad for p in params if p.grad is not None)
    for p in params:
        p.grad = None
    return sum(storages.values()), grads


def _bucket_bytes(engine) -> int:
    """DDP's flat gradient buckets, as DDP itself reports them."""
    if engine._ddp is None:
        return 0
    sizes = str(engine._ddp._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(x) for x in sizes.split(",") if x.strip())


def _peak_grad_bytes(engine, param_bytes: int) -> int:
    """The gradients' bytes at their peak, between steps when none exist: as large as the
    parameters, except in an FSDP2 pipeline stage, whose gradients accumulate unsharded
    (`state_tensors`) in the master weights' dtype (the reduce dtype under a low-precision policy)."""
    records = fsdp_params(engine.model) if engine.parallel_config.pp > 1 else []
    if not records:
        return param_bytes
    return sum(math.prod(r._orig_size) * r.sharded_param.element_size() for r in records)


def measure(engine, baseline_bytes: int) -> dict[str, int]:
    """The ledgers measured on this rank: all four where the probe can run alone, else the state.

    The state ledger is counted on every layout (`held_state_bytes`). Called between steps,
    when the engine holds no gradients, it counts them at their peak: one per parameter, of
    the parameter's local shape (FSDP2's sharded gradients have its padded shard's size;
    inside a pipeline FSDP2's gradients are unsharded at their peak: `_peak_grad_bytes`).
    The activation probe runs one microbatch's forward and backward on the calling rank
    only. With tensor or pipeline parallelism, or sharded (FSDP, ZeRO-1) state, that forward
    or its optimizer has collectives the other ranks would never join, so those layouts
    report the state ledger alone.
    """
    held = held_state_bytes(engine)
    if not getattr(engine, "whole_state", True) or engine.parallel_config.pp > 1:
        grads = held["grads"] or _peak_grad_bytes(engine, held["params"])
        return {"state": held["params"] + grads + held["optimizer"] + held["scaler"]}
    activation, grads = _probe_microbatch(engine)
    state = held["params"] + grads + held["optimizer"] + held["scaler"]
    collective = _bucket_bytes(engine)
    growth = _peak_bytes(engine.device) - baseline_bytes
    transient = max(0, growth - state - activation - collective)
    return {"state": state, "activation": activation, "collective": collective, "transient": transient}
