"""Megatron tensor parallelism for trainer.model's GPT (or a pipeline stage of it) via DTensor.

Protocol: the engine calls `apply_tensor_parallel(module, tp_mesh, sequence_parallel)` once, on
every rank of the tp group, right after building the model and before activation
checkpointing and data parallelism (the fixed order TP -> recompute -> FSDP/DDP, see
trainer/engine.py). Afterwards the module's split parameters are DTensors on `tp_mesh`; their
names do not change. The forward then returns DTensor logits sharded over the vocabulary,
and the loss must run under `loss_context(tp)` (torch's `loss_parallel`), backward included,
so that the logits are never gathered.

The plan (Shoeybi et al. 2019, arXiv:1909.08053; sequence parallelism: Korthikanti et al.
2022, arXiv:2205.05198), for whichever of these submodules `module` has:

    tok_emb            VocabParallelEmbedding: RowwiseParallel (weight split on the
                       vocabulary) with the lookup and its backward on the local rows only
    blocks.<i>.attn    q/k/v ColwiseParallel (query and key/value heads split: tp divides
                       n_kv_heads, so each rank's query heads find their kv heads locally),
                       o_proj RowwiseParallel
    blocks.<i>.mlp     gate/up ColwiseParallel, down RowwiseParallel
    norm -> head       the final norm's output becomes a Replicate DTensor; the head weight
                       (lm_head, or tok_emb's with tied embeddings: both split on the
                       vocabulary, so tying needs nothing extra) gives logits Shard(-1)
    with sequence parallelism: the norms run on sequence shards (SequenceParallel), each
    block's attention and MLP all-gather their input and reduce-scatter their output.

`blocks` may be a ModuleList or a ModuleDict keyed by layer index (a pipeline stage). The
attention derives its head count from the projection width, so it runs unchanged on its
heads. Under sequence parallelism every sequence must split evenly over tp: the engine pads
microbatches with `pad_to_multiple` (padding carries no loss and, being at the end of a
causal sequence, changes no other position).
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from trainer.data import Batch
from trainer.loss import IGNORE_INDEX


def _blocks(module: nn.Module) -> list[nn.Module]:
    blocks = getattr(module, "blocks", None)
    if blocks is None:
        return []
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def _block_plan(sequence_parallel: bool) -> dict:
    # Without SP the block's input is replicated on every tp rank and the row-parallel
    # outputs are all-reduced; with SP the input is a sequence shard, gathered once per
    # attention / MLP (PrepareModuleInput), and the outputs are reduce-scattered.
    out = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=out),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=out),
    }
    if sequence_parallel:
        plan.update({
            "attn_norm": SequenceParallel(),
            "mlp_norm": SequenceParallel(),
            # The second input of attention (the RoPE tables) is a plain tensor pair: left alone.
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


class VocabParallelEmbedding(RowwiseParallel):
    """RowwiseParallel for an nn.Embedding whose gradient stays on the rank's vocabulary rows.

    DTensor's embedding backward has no vocabulary-sharded strategy: it all-gathers the output
    gradient and computes a Replicate gradient of the whole vocabulary on every tp rank, which
    FSDP2 then holds unsharded from a pipeline stage's backward to the step's reduction
    (Llama 3's 128k x 4096 embedding: 2.1 GB per rank in fp32 where its shard at tp 8 is 263
    MB). Here the lookup runs on local tensors as Megatron's VocabParallelEmbedding does:
    ids outside the rank's rows are masked to row 0 and their outputs zeroed, the result is a
    Partial DTensor that the output layout reduces (all-reduce, or reduce-scatter under
    sequence parallelism), and autograd's gradient for the weight is the local rows' only,
    a Shard(0) DTensor (equal to the unsplit model's gradient: tests/dist/test_engine_parallel.py).
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding splits an nn.Embedding, not a {type(module).__name__}")
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise ValueError("VocabParallelEmbedding supports a plain nn.Embedding: padding_idx, max_norm "
                             "and sparse gradients are not split over the vocabulary; leave them unset")
        module = super()._apply(module, device_mesh)
        module.forward = types.MethodType(_local_rows_lookup, module)
        return module


def _local_rows_lookup(module: nn.Embedding, input_ids) -> DTensor:
    """The embedding's forward after VocabParallelEmbedding: this rank's rows' share of the
    lookup, a Partial DTensor on the weight's tp mesh (FSDP2's unsharded weight included)."""
    weight = module.weight
    shard = weight.to_local()  # its backward wraps the local gradient as Shard(0) again
    first = weight.device_mesh.get_local_rank() * shard.shape[0]  # tp divides the vocabulary
    ids = input_ids.to_local() if isinstance(input_ids, DTensor) else input_ids
    outside = (ids < first) | (ids >= first + shard.shape[0])
    rows = F.embedding((ids - first).masked_fill(outside, 0), shard)
    rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
    return DTensor.from_local(rows, weight.device_mesh, [Partial()], run_check=False)


def _replicated_head_input(tp_mesh):
    """Forward hook for the final norm: its output as a Replicate DTensor, the head's input.

    The head weight is split on the vocabulary (Shard(0)), so x @ W^T with x replicated is
    the column-parallel matmul with no communication; its logits come out Shard(-1).
    """

    def hook(_module, _inputs, output):
        if isinstance(output, DTensor):
            return output.redistribute(tp_mesh, [Replicate()])  # all-gather of the sequence shards
        return DTensor.from_local(output, tp_mesh, [Replicate()], run_check=False)

    return hook


def apply_tensor_parallel(module: nn.Module, tp_mesh, sequence_parallel: bool) -> nn.Module:
    """Split `module` (a GPT or a pipeline stage of one) over `tp_mesh` in place; returns it."""
    has_pos = getattr(module, "pos_emb", None) is not None
    for block in _blocks(module):
        if hasattr(block.mlp, "gate_proj"):
            parallelize_module(block, tp_mesh, {"mlp.gate_proj": ColwiseParallel()})
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
        if not sequence_parallel:  # the tp ranks' generators agree: their heads' dropout is salted apart
            block.attn.head_salt = tp_mesh.get_local_rank()
    top: dict = {}
    if getattr(module, "tok_emb", None) is not None:
        # Learned positions are added to the whole sequence before it is split, so the
        # embedding then all-reduces and the split happens at the dropout's input.
        shard_now = sequence_parallel and not has_pos
        top["tok_emb"] = VocabParallelEmbedding(input_layouts=Replicate(),
                                                output_layouts=Shard(1) if shard_now else Replicate())
    if sequence_parallel and has_pos:
        if not isinstance(getattr(module, "drop", None), nn.Module):
            raise ValueError("sequence parallelism with learned positions needs the module's `drop` (dropout) "
                             "submodule, where the sequence is split")
        top["drop"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                         use_local_output=True)
    if getattr(module, "norm", None) is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if getattr(module, "lm_head", None) is not None:
        # Works whether the forward calls lm_head(x) or F.linear(x, lm_head.weight).
        top["lm_head"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(module, tp_mesh, top)
    if getattr(module, "norm", None) is not None:
        module.norm.register_forward_hook(_replicated_head_input(tp_mesh))
    return module


def loss_context(tp: int) -> contextlib.AbstractContextManager:
    """Where the loss and its backward run: `loss_parallel` when the logits are vocab-sharded."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def pad_to_multiple(batch: Batch, multiple: int) -> Batch:
    """Right-pad a microbatch's sequence to a multiple of `multiple` (no-loss positions)."""
    width = batch.input_ids.shape[1]
    extra = -width % multiple
    if extra == 0:
        return batch
    rows = batch.input_ids.shape[0]
    input_ids = torch.cat([batch.input_ids, torch.zeros(rows, extra, dtype=batch.input_ids.dtype)], dim=1)
    labels = torch.cat([batch.labels, torch.full((rows, extra), IGNORE_INDEX, dtype=batch.labels.dtype)], dim=1)
    return Batch(input_ids, labels)
