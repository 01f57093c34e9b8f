"""Cutting the GPT into pipeline chunks, and the module each chunk runs.

Planning is pure arithmetic (unit-tested without processes):

  * `split_layers` cuts the n_layers blocks into `pp * virtual_stages` contiguous chunks,
    balanced by training FLOPs per token rather than by layer count: the first chunk also
    carries the embedding, the last the final norm and LM head, whose 6 * vocab * d_model
    FLOPs are several blocks' worth when the vocabulary is large (Llama-3's head is about
    four of its 1B model's blocks). The costs are `trainer.model.flops_per_token`'s terms,
    so the chunks' costs add up to exactly that count.
  * `chunk_ranks` places chunk c on a pipeline rank: round robin (`loop`, chunk c on rank
    c % pp: GPipe, 1F1B, interleaved 1F1B; Narayanan et al. 2021) or the V shape of the
    zero-bubble ZB-V schedule (`v`, rank r holds chunks r and 2*pp-1-r; Qi et al. 2024,
    arXiv:2401.10241, section 6), so that the first and the last chunk share rank 0.

`StageModel` is the part of the GPT one chunk runs. Its parameter names equal the full
model's (`blocks.5.attn.q_proj.weight`, ...) because checkpoints address state by those
names, and `build_stage` initialises them exactly as `trainer.model.build_model` does (the
init seeds every parameter from (seed, name)), so the stages of a pipeline hold, together,
the full model's initial weights.

Tied embeddings with pp > 1 (Megatron-LM's treatment of shared embeddings, Shoeybi et al.
2019): the last chunk holds its own copy of `tok_emb.weight` for the LM head, initialised
identically; after each backward the two copies' gradients are summed between the first and
the last chunk (`trainer.pipeline.sync_tied_grads`), so identical optimizer updates keep them
equal. `StageModel.replica_names` lists the copy: a checkpoint writes it from the first chunk
only, and a load fills both copies from the one entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig
from trainer.init_values import init_parameters, materialize
from trainer.model import Block, init_rope_buffers, make_norm

Placement = Literal["loop", "v"]


@dataclass(frozen=True)
class Chunk:
    """One contiguous piece of the model: blocks `layers` plus the ends it carries."""

    index: int
    layers: range
    first: bool  # holds the token embedding (and learned positions)
    last: bool  # holds the final norm and the LM head
    flops_per_token: int  # training FLOPs per token of this chunk (forward + backward)


def layer_flops(cfg: ModelConfig, seq_len: int) -> tuple[int, int, int]:
    """(embedding, one block, head) training FLOPs per token, the terms of `flops_per_token`.

    A block: 6 per projection weight plus 12 * d_model * seq_len for attention scores and
    values. The head: 6 * vocab * d_model. The embedding lookup multiplies nothing: 0.
    """
    d = cfg.d_model
    block = 6 * (cfg.attention_params + cfg.mlp_params) + 12 * d * seq_len
    return 0, block, 6 * cfg.vocab_size * d


def cut_problem(n_layers: int, n_chunks: int) -> str | None:
    """Why `n_layers` blocks cannot be cut into `n_chunks` chunks, or None when they can.

    Every chunk but the last needs a block (the last may hold only the head), so
    1 <= n_chunks <= n_layers + 1. `partition` raises it; trainer.layout_checks refuses it.
    """
    if n_chunks < 1:
        return f"need at least one chunk, got {n_chunks}"
    if n_chunks > n_layers + 1 or (n_chunks == 1 and n_layers == 0):
        return (f"cannot cut {n_layers} layers into {n_chunks} pipeline chunks (pp * virtual_stages): every "
                "chunk but the last needs a layer; lower parallel.pp or parallel.virtual_stages, or add layers")
    return None


def partition(costs: list[int], n_chunks: int, first_extra: int = 0, last_extra: int = 0) -> list[range]:
    """Contiguous ranges of `costs` minimising the costliest chunk, then the sum of squared costs.

    Chunk 0 adds `first_extra`, the last chunk `last_extra`. Every chunk holds at least one
    item except the last, which may hold only its extra (a head-only stage, when the head
    alone costs as much as the other chunks). The second criterion spreads the slack that
    the bottleneck leaves instead of piling it on one chunk; remaining ties go to the cut
    with fewer items in earlier chunks, which in 1F1B hold the most activations in flight.
    """
    n = len(costs)
    problem = cut_problem(n, n_chunks)
    if problem is not None:
        raise ValueError(problem)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def chunk_cost(c: int, i: int, j: int) -> int:
        return prefix[j] - prefix[i] + (first_extra if c == 0 else 0) + (last_extra if c == n_chunks - 1 else 0)

    def ends(c: int, i: int) -> range:
        # chunk c covers [i, j); the chunks after it need one item each, except the last
        if c == n_chunks - 1:
            return range(n, n + 1)
        return range(i + 1, n - (n_chunks - 2 - c) + 1)

    def solve(combine, leaf_ok) -> list[list[float]]:
        best = [[math.inf] * (n + 1) for _ in range(n_chunks + 1)]
        best[n_chunks][n] = 0
        for c in range(n_chunks - 1, -1, -1):
            for i in range(n + 1):
                for j in ends(c, i):
                    if leaf_ok(chunk_cost(c, i, j)) and best[c + 1][j] < math.inf:
                        best[c][i] = min(best[c][i], combine(chunk_cost(c, i, j), best[c + 1][j]))
        return best

    bottleneck = solve(max, lambda cost: True)[0][0]
    squares = solve(lambda cost, rest: cost * cost + rest, lambda cost: cost <= bottleneck)
    cuts, start = [], 0
    for c in range(n_chunks):
        for j in ends(c, start):
            cost = chunk_cost(c, start, j)
            if cost <= bottleneck and cost * cost + squares[c + 1][j] == squares[c][start]:
                cuts.append(range(start, j))
                start = j
                break
    return cuts


def split_layers(cfg: ModelConfig, seq_len: int, n_chunks: int) -> list[Chunk]:
    """The model cut into `n_chunks` contiguous chunks balanced by training FLOPs (see `partition`)."""
    embedding, block, head = layer_flops(cfg, seq_len)
    ranges = partition([block] * cfg.n_layers, n_chunks, first_extra=embedding, last_extra=head)
    chunks = []
    for c, layers in enumerate(ranges):
        first, last = c == 0, c == n_chunks - 1
        flops = block * len(layers) + (embedding if first else 0) + (head if last else 0)
        chunks.append(Chunk(index=c, layers=layers, first=first, last=last, flops_per_token=flops))
    return chunks


def default_virtual_stages(schedule: str) -> int:
    """Chunks per pipeline rank when parallel.virtual_stages is not set.

    Interleaved 1F1B runs two (the smallest number that halves the bubble); ZB-V and
    DualPipeV are V-shaped, exactly two per rank; every other schedule one.
    """
    return 2 if schedule in ("interleaved", "zero-bubble") else 1


def placement_of(schedule: str) -> Placement:
    """How `schedule` places chunks on ranks: the V shape for zero-bubble (ZB-V), else round robin."""
    return "v" if schedule == "zero-bubble" else "loop"


def chunk_ranks(pp: int, virtual_stages: int, placement: Placement = "loop") -> list[int]:
    """Pipeline rank of each of the pp * virtual_stages chunks.

    loop: chunk c on rank c % pp. v: a zigzag, down the ranks then back up, so rank r holds
    chunks r and 2*pp-1-r when virtual_stages is 2 (torch's `generate_stage_to_rank_mapping`
    with style "v", which the ZB-V schedule assumes).
    """
    if pp < 1 or virtual_stages < 1:
        raise ValueError(f"pp={pp} and virtual_stages={virtual_stages} must be positive")
    n_chunks = pp * virtual_stages
    if placement == "loop":
        return [c % pp for c in range(n_chunks)]
    if placement != "v":
        raise ValueError(f"unknown placement {placement!r}; expected 'loop' or 'v'")
    ranks = []
    for c in range(n_chunks):
        sweep, offset = divmod(c, pp)
        ranks.append(offset if sweep % 2 == 0 else pp - 1 - offset)
    return ranks


def local_chunks(pp: int, virtual_stages: int, placement: Placement, rank: int) -> list[int]:
    """The chunk indices pipeline rank `rank` holds, in increasing order."""
    if not 0 <= rank < pp:
        raise ValueError(f"pipeline rank {rank} is outside 0..{pp - 1}")
    return [c for c, r in enumerate(chunk_ranks(pp, virtual_stages, placement)) if r == rank]


class StageModel(nn.Module):
    """The blocks of one chunk, with the embedding on the first and the norm + head on the last.

    First chunk: token ids (B, T) int64 -> hidden (B, T, d_model). Middle chunks: hidden ->
    hidden. Last chunk: hidden -> logits (B, T, vocab). A chunk that is both runs the whole
    model (same function as `trainer.model.GPT`). Build it with `build_stage`.
    """

    def __init__(self, cfg: ModelConfig, layers: range, first: bool, last: bool):
        super().__init__()
        self.cfg, self.is_first, self.is_last = cfg, first, last
        self.layer_ids = layers
        # Under sequence parallelism a non-first chunk receives its tp rank's shard of the
        # sequence: the positions (RoPE rows) it needs are those of the whole sequence,
        # seq_split times the shard's length. Set by whoever applies tensor parallelism.
        self.seq_split = 1
        # the last chunk's copy of the tied embedding, for the head (see the module docstring)
        tied_copy = last and not first and cfg.tie_embeddings
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model) if first or tied_copy else None
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if first and cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        # Keyed by the global layer index, so names are "blocks.<i>..." as in the full model.
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        self.norm = make_norm(cfg) if last else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if last and not cfg.tie_embeddings else None
        self.replica_names: frozenset[str] = frozenset({"tok_emb.weight"} if tied_copy else ())
        if cfg.position == "rope" and len(layers):
            self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1] if self.is_first else x.shape[1] * self.seq_split
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if self.is_first:
            x = self.tok_emb(x)
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(seq, device=x.device))
            x = self.drop(x)
        rope = (self.rope_cos[:seq], self.rope_sin[:seq]) if hasattr(self, "rope_cos") else None
        for block in self.blocks.values():
            x = block(x, rope)
        if not self.is_last:
            return x
        x = self.norm(x)
        head = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """`trainer.model.GPT.init_weights` restricted to this chunk: each parameter from (seed, name)
        (and element offset, so a sharded chunk fills its slices; trainer.init_values).

        The residual projections' std uses the full model's depth, cfg.n_layers, not the chunk's.
        """
        init_parameters(self, self.cfg, seed)
        init_rope_buffers(self, self.cfg)


def meta_stage(cfg: ModelConfig, chunk: Chunk) -> StageModel:
    """The StageModel of `chunk` on the meta device (see `trainer.model.meta_model`)."""
    with torch.device("meta"):
        return StageModel(cfg, chunk.layers, first=chunk.first, last=chunk.last)


def build_stage(cfg: ModelConfig, seed: int, chunk: Chunk, device: str | torch.device = "cpu") -> StageModel:
    """The StageModel of `chunk`, initialised as `build_model(cfg, seed)` initialises those names."""
    return materialize(meta_stage(cfg, chunk), seed, device)
