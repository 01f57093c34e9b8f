"""Initial parameter values as a pure function of (seed, parameter name, element offset).

Why: a rank must be able to compute the initial values of exactly the slice of a parameter it
holds (after tensor parallelism, FSDP and pipeline staging have cut the model), without ever
holding the whole tensor, and every layout, the single process included, must start from the
same weights. So the values of the logical tensor `name` never depend on how it is cut:

    flatten the logical tensor in row-major order and cut it into blocks of BLOCK elements;
    block b holds BLOCK standard normals drawn (numpy's ziggurat) from a Philox-4x64 generator
    (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3") whose 128-bit key is
    derived from (seed, name) and whose counter starts at b * 2^128;
    the initial value is that normal times the parameter's std (norm gains are 1).

Any slice is computed from the blocks it overlaps, one band of rows at a time, so the memory
a rank spends beyond its own share is bounded (about SPAN elements of temporaries) whatever
the model's size. The blocks are fixed, so whole and sliced computations are bit-identical;
the stream is numpy's Philox and ziggurat, stable for a given numpy version (numpy does not
promise the same normals across its versions: a resumed job restores its weights from its
checkpoint, never by re-initialising).

Protocol: a model is built on the meta device (`trainer.model.meta_model`,
`trainer.stages.meta_stage`), parallelised there (tensor parallelism, recomputation, FSDP2
when the engine uses it), and then `materialize(module, seed, device)` allocates only the
local shards (`to_empty`) and calls the module's `init_weights(seed)`, which fills each
parameter, a plain tensor or a DTensor shard, through `init_parameters`. DDP and ZeRO-1 wrap
after materialisation (DDP broadcasts, and the TP-to-local swap clones, real values); FSDP2
before it (so only the shard is ever allocated). Meta tensors are left as they are (a
model "materialised" on the meta device stays a shape-only model).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainer.config import ModelConfig

INIT_STD = 0.02
BLOCK = 1 << 16  # elements per independently drawn block of a logical tensor
SPAN = 1 << 20  # elements of the logical tensor covered per band (bounds the temporaries)
RESIDUAL = ("o_proj.weight", "down_proj.weight")


def param_std(cfg: ModelConfig, name: str) -> float | None:
    """GPT-2's rule (Radford et al. 2019, section 2.3): N(0, 0.02), the projections that write
    into the residual stream 0.02/sqrt(2 * n_layers) (always the full model's depth, also for a
    pipeline stage); None for norm gains, which start at 1."""
    if name.endswith("norm.weight"):
        return None
    return INIT_STD / math.sqrt(2 * cfg.n_layers) if name.endswith(RESIDUAL) else INIT_STD


def _key(seed: int, name: str) -> list[int]:
    # blake2b, not hash(): Python's string hash is randomised per process.
    digest = hashlib.blake2b(f"{seed}/init/{name}".encode(), digest_size=16).digest()
    return [int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")]


def _draw_blocks(key: list[int], blocks: torch.Tensor, last_length: int = BLOCK) -> torch.Tensor:
    """(len(blocks), BLOCK) float32 standard normals, row i being block `blocks[i]`; of the last
    row only the first `last_length` are drawn (the rest is left undefined). A shorter draw is a
    prefix of the full block's (one normal after the other from one stream), so a small tensor
    costs its own size, not a block's."""
    out = np.empty((len(blocks), BLOCK), dtype=np.float32)
    ids = blocks.tolist()
    for row, block in enumerate(ids):
        generator = np.random.Generator(np.random.Philox(key=key, counter=[0, 0, block, 0]))
        length = last_length if row == len(ids) - 1 else BLOCK
        generator.standard_normal(out=out[row, :length], dtype=np.float32)
    return torch.from_numpy(out)


def standard_normal_slice(seed: int, name: str, shape: tuple[int, ...], offsets: tuple[int, ...],
                          lengths: tuple[int, ...]) -> torch.Tensor:
    """Elements [offsets, offsets + lengths) of the logical standard-normal tensor `name` of
    `shape` (CPU, float32, shape `lengths`). Memory is proportional to the slice's span in the
    flattened tensor: callers cut large slices into bands (`init_parameters` does)."""
    shape, offsets, lengths = tuple(shape) or (1,), tuple(offsets) or (0,), tuple(lengths) or (1,)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    key = _key(seed, name)
    if math.prod(lengths) == 0:
        return torch.empty(lengths, dtype=torch.float32)
    if tuple(lengths[1:]) == tuple(shape[1:]):
        # Whole rows (a dim-0 shard, or the whole tensor): one contiguous run of the flat order.
        start = offsets[0] * strides[0]
        end = start + math.prod(lengths)
        first, last = start // BLOCK, (end - 1) // BLOCK
        drawn = _draw_blocks(key, torch.arange(first, last + 1), end - last * BLOCK).view(-1)
        return drawn[start - first * BLOCK:end - first * BLOCK].view(lengths)  # a view of a fresh buffer
    flat = torch.zeros((), dtype=torch.int64)
    for d, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        index = (torch.arange(length, dtype=torch.int64) + offset) * strides[d]
        flat = flat.unsqueeze(-1) + index  # broadcast: row-major order of the slice
    flat = flat.reshape(-1)
    needed = torch.unique(flat // BLOCK)  # sorted
    drawn = _draw_blocks(key, needed, int(flat.max()) % BLOCK + 1)
    rows = torch.searchsorted(needed, flat // BLOCK)
    return drawn[rows, flat % BLOCK].view(lengths)


def slice_of(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, offsets, lengths) of the part of the logical tensor `param` holds locally."""
    if isinstance(param, DTensor):
        lengths, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(param.shape), tuple(offsets), tuple(lengths)
    return tuple(param.shape), (0,) * param.ndim, tuple(param.shape)


def fill_slice(out: torch.Tensor, seed: int, name: str, std: float, shape: tuple[int, ...],
               offsets: tuple[int, ...]) -> None:
    """Write std * (the standard-normal slice of `name` at `offsets`, shaped like `out`) into
    `out` (any device), one band of dim-0 rows at a time."""
    lengths = tuple(out.shape)
    if out.ndim == 0 or math.prod(lengths) == 0:
        if out.ndim == 0:
            out.copy_(standard_normal_slice(seed, name, shape, offsets, lengths).mul_(std).view(()))
        return
    row = math.prod(shape[1:])
    band = max(1, SPAN // max(row, 1))
    for start in range(0, lengths[0], band):
        rows = min(band, lengths[0] - start)
        values = standard_normal_slice(seed, name, shape, (offsets[0] + start, *offsets[1:]), (rows, *lengths[1:]))
        out[start:start + rows].copy_(values.mul_(std))


@torch.no_grad()
def init_parameters(module: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Fill every parameter of `module` (named as in the full model) with its initial values, or
    with the slice of them this rank holds when it is a DTensor (TP split, FSDP shard)."""
    for name, param in module.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.is_meta:
            continue
        std = param_std(cfg, name)
        if std is None:
            local.fill_(1.0)
            continue
        shape, offsets, lengths = slice_of(param)
        if tuple(local.shape) != lengths:
            raise RuntimeError(f"{name}: the local tensor is {tuple(local.shape)}, its placements say {lengths}")
        fill_slice(local.detach(), seed, name, std, shape, offsets)


def materialize(module: nn.Module, seed: int, device: str | torch.device) -> nn.Module:
    """Allocate `module`'s (meta) parameters and buffers on `device`, only the local shards, and
    initialise them with `module.init_weights(seed)`; returns the module. See the protocol above."""
    module.to_empty(device=device)
    with torch.no_grad():
        module.init_weights(seed)
    return module
