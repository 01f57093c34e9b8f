"""Which server owns which part of the model: a pure plan, balanced by bytes.

The model's parameters are cut into pieces, each a `trainer.state_slices.TensorSlice` of the
logical tensor `model/<param name>` (the checkpoint library's slice model), so a server's shard
is a list of slices that a later PS checkpoint stores exactly as a collective job stores its
own: one logical tensor, any cut. A piece is a whole tensor, or a band of dim-0 rows of a
tensor larger than `max_piece_bytes` (the embedding is the typical one: its rows are what the
sparse path pushes and pulls).

Pieces go largest first to the least-loaded server (LPT, Graham 1969): every server ends
within one piece of the mean, so the split bound `max_piece_bytes` is also the imbalance
bound. Called once per job by the driver (and by each worker to know where its gradients go);
deterministic, so every process computes the same plan from the same shapes.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from trainer.state_slices import TensorSlice

PARAM_PREFIX = "model/"


@dataclass(frozen=True)
class ParamShape:
    name: str  # the parameter's name in trainer.model (tok_emb.weight, blocks.0.attn.q_proj.weight, ...)
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def param_shapes(named_params) -> list[ParamShape]:
    """ParamShapes of `module.named_parameters()` (a meta model is enough)."""
    return [ParamShape(name, tuple(p.shape), p.dtype) for name, p in named_params]


def default_piece_bytes(params: list[ParamShape], servers: int) -> int:
    """A quarter of each server's mean share: no server more than 25% above the mean."""
    total = sum(p.nbytes for p in params)
    return max(1, total // (4 * servers))


def _pieces(param: ParamShape, max_piece_bytes: int) -> list[TensorSlice]:
    shape, name = param.shape, PARAM_PREFIX + param.name
    zeros = (0,) * len(shape)
    if param.nbytes <= max_piece_bytes or len(shape) == 0 or shape[0] <= 1:
        return [TensorSlice(name, param.dtype, shape, zeros, shape)]
    row_bytes = param.nbytes // shape[0]
    rows = max(1, max_piece_bytes // row_bytes)
    bands = -(-shape[0] // rows)
    rows = -(-shape[0] // bands)  # even bands: no runt at the end
    return [TensorSlice(name, param.dtype, shape, (start, *zeros[1:]), (min(rows, shape[0] - start), *shape[1:]))
            for start in range(0, shape[0], rows)]


def plan_shards(params: list[ParamShape], servers: int, max_piece_bytes: int | None = None) -> list[list[TensorSlice]]:
    """The slices each of `servers` servers owns (geometry only, `tensor` None); every element of
    every parameter is in exactly one slice. Within a shard, slices keep the model's order."""
    if servers < 1:
        raise ValueError(f"servers={servers}: a job needs at least one server")
    limit = max_piece_bytes or default_piece_bytes(params, servers)
    order = {p.name: i for i, p in enumerate(params)}
    pieces = [piece for p in params for piece in _pieces(p, limit)]
    # Largest first; ties broken by model order so the plan is the same in every process.
    pieces.sort(key=lambda s: (-s.nbytes, order[s.name[len(PARAM_PREFIX):]], s.offsets))
    loads = [(0, k) for k in range(servers)]
    shards: list[list[TensorSlice]] = [[] for _ in range(servers)]
    for piece in pieces:
        load, k = heapq.heappop(loads)
        shards[k].append(piece)
        heapq.heappush(loads, (load + piece.nbytes, k))
    for shard in shards:
        shard.sort(key=lambda s: (order[s.name[len(PARAM_PREFIX):]], s.offsets))
    return shards


def shard_bytes(shard: list[TensorSlice]) -> int:
    return sum(piece.nbytes for piece in shard)


def param_name(piece: TensorSlice) -> str:
    """The trainer.model parameter a slice cuts."""
    return piece.name[len(PARAM_PREFIX):]
