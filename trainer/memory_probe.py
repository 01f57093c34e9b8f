"""Measure a rank's memory by ledger, for comparison with the cost model's prediction.

The four ledgers of design.md section 1, measured rather than predicted:
  * state: bytes of parameters, gradients and optimizer state actually allocated;
  * activation: bytes autograd saves for backward during one microbatch's forward, counted
    with `saved_tensors_hooks` (unique storages, so views are not double-counted);
  * collective: DDP's gradient bucket buffers, as DDP reports their sizes;
  * transient: the rest of the process's peak memory growth since the engine was built
    (workspaces, allocator slack): peak RSS on CPU, peak allocated on CUDA.

Protocol: a rank calls `measure(engine, baseline_bytes)` once per generation, after its first
training step (so gradients and optimizer state exist); `baseline_bytes` is `current_bytes()`
taken before the engine was built. The probe runs one extra forward and backward of one
microbatch under `no_sync` and drops the gradients it made, so training state is unchanged.
"""

from __future__ import annotations

import contextlib
import resource

import torch

from trainer.loss import token_loss_sum


def current_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _probe_microbatch(engine) -> tuple[int, int]:
    """(activation bytes saved for backward, gradient bytes) of one microbatch.

    Runs forward and backward of one microbatch locally (`no_sync`: no collective, so only
    the calling rank needs to run it), then drops the gradients again: the engine clears
    gradients after every optimizer step, so its state is exactly as before.
    """
    batch = engine.data.microbatches(engine.next_step, engine.train_config.global_batch,
                                     engine.train_config.micro_batch, engine.dp_rank, engine.dp_size)[0]
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


def measure(engine, baseline_bytes: int) -> dict[str, int] | None:
    """The four ledgers measured on this rank, or None where a probe cannot run alone.

    The probe runs one microbatch's forward and backward on the calling rank only. With
    tensor or pipeline parallelism, or sharded (FSDP) parameters, that forward has
    collectives the other ranks would never join, so those layouts are not probed.
    """
    if not getattr(engine, "whole_state", True) or engine.parallel_config.pp > 1:
        return None
    params = list(engine.model.parameters())
    activation, grads = _probe_microbatch(engine)
    state = _tensor_bytes(params) + grads
    for per_param in engine.optimizer.state.values():
        state += _tensor_bytes(v for v in per_param.values() if torch.is_tensor(v))
    collective = _bucket_bytes(engine)
    growth = _peak_bytes(engine.device) - baseline_bytes
    transient = max(0, growth - state - activation - collective)
    return {"state": state, "activation": activation, "collective": collective, "transient": transient}
