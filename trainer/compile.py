"""`train.compile`: torch.compile per transformer block, after recomputation (as TorchTitan does).

Protocol: the engine calls `apply_recompute_and_compile(module, recompute, compile)` once per
model or pipeline stage, after tensor parallelism and before data parallelism (the order of
trainer/engine.py), in place of `trainer.recompute.apply_recompute`. Without `compile` it is
exactly `apply_recompute`.

What is compiled: each `Block` (the whole model's or a stage's), one at a time, in place, with
`nn.Module.compile`: the module is not wrapped, so parameter names, and with them the
checkpoint format, do not change, and FSDP2 can still make each block one unit (its hooks run
eagerly around the compiled forward: dynamo skips FSDP's hooks). The blocks share one
compiled graph (dynamo treats a module's parameters as inputs), so a model compiles once, not
once per layer. `fullgraph=True`: a graph break would be a silent slowdown, so it is an error.
The embedding, the final norm, the LM head and the loss stay eager.

Recomputation under compile: the composable `checkpoint` of trainer.recompute hooks the
block's forward from outside with a context manager dynamo cannot trace (a graph break), so a
compiled block checkpoints inside its own forward instead: `torch.utils.checkpoint.checkpoint`
with the same policy (everything, or trainer.recompute's selective one), which dynamo traces
as a higher-order op, so the recomputation is part of the compiled backward. What is kept and
what is recomputed is the same as without compile.

Numerics: inductor fuses element-wise work, so losses differ from eager in the last bits
(verified within 1e-5 of the eager single-process run, parameters within 1e-4, on every
layout the engine offers compile with: docs/design.md). Dropout under compile draws its
masks from inductor's generator, seeded from torch's (still a pure function of the
per-step seed), so with dropout > 0 the masks differ from an eager run's.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.recompute import apply_recompute, blocks_of, selective_context


def apply_recompute_and_compile(module: nn.Module, recompute: str, compile: bool) -> nn.Module:
    """Recompute (parallel.recompute) then compile (train.compile) every block of `module`, a
    GPT or a pipeline stage, in place; returns it (module docstring)."""
    if not compile:
        return apply_recompute(module, recompute)
    apply_recompute(nn.Module(), recompute)  # validates the mode (a module without blocks: nothing hooked)
    for block in blocks_of(module):
        if recompute != "none":
            block.forward = partial(_checkpointed, block.forward, recompute)
        block.compile(fullgraph=True)
    return module


def _checkpointed(forward, mode: str, *args):
    # Traced inside the block's compiled forward. preserve_rng_state replays dropout exactly.
    context_fn = selective_context if mode == "selective" else None
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn)
