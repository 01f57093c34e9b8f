"""Activation recomputation (checkpointing) of transformer blocks, by `parallel.recompute`.

    none       autograd keeps every activation the backward needs
    block      each Block keeps only its input; its forward is re-run inside backward
    selective  each Block also keeps the outputs of its matrix multiplies (and of the
               tensor-parallel reductions, all-reduce and reduce-scatter, so recomputation
               repeats neither); a sequence-parallel all-gather is repeated, as in TorchTitan's
               policy: its output is the whole sequence's activation, tp times the shard kept;
               the cheap rest (norms, RoPE, the attention core, activations, dropout) is
               recomputed (torch's selective activation checkpointing; in the manner of
               Korthikanti et al. 2022, arXiv:2205.05198)

Protocol: the engine calls `apply_recompute(module, mode)` once, after tensor parallelism and
before data parallelism (trainer/engine.py's order). It uses the composable `checkpoint`,
which hooks the block's forward without wrapping it, so parameter names do not change
and FSDP can still make each block one unit. Dropout masks are replayed exactly:
the RNG state is saved with each block's input (preserve_rng_state).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MODES = ("none", "block", "selective")

_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
}


def _save_matmuls(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The `context_fn` of selective recomputation (torch's selective activation checkpointing)."""
    return create_selective_checkpoint_contexts(_save_matmuls)


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a GPT or a pipeline stage, in order."""
    blocks = getattr(module, "blocks", None)
    if blocks is None:
        return []
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def apply_recompute(module: nn.Module, mode: str) -> nn.Module:
    """Checkpoint every block of `module` (a GPT or a pipeline stage) in place; returns it."""
    if mode not in MODES:
        raise ValueError(f"parallel.recompute={mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return module
    context_fn = selective_context if mode == "selective" else None
    for block in blocks_of(module):
        checkpoint(block, context_fn=context_fn)
    return module
