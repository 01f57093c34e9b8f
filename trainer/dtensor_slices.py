"""Which slice of each logical tensor a rank holds, whatever the layout (trainer.state_slices).

A rank's piece of a parameter is described by the placements of its local tensor on the
(dp, tp) grid: a TP split (DTensor on the tp mesh), an FSDP shard (DTensor on the dp mesh, or
on the 2D dp x tp mesh, where FSDP2 shards the TP shard again with _StridedShard), or
nothing (a plain tensor). Under HSDP the grid's dp splits into (dp_replicate, dp_shard), the
dim names of FSDP2's 2-D mesh, whose placements are (Replicate(), Shard(0)): the shard is
the same in every replica, so each replica's copy counts as one more holder.
torch's `compute_local_shape_and_global_offset` turns placements into (offsets, lengths) in
the logical tensor, uneven shards included. Every grid dimension
on which the piece is *not* sharded replicates it: the ranks that differ only there hold the
identical slice, and each reports its index among them (`replica` of `replicas`), so DDP
replicas, TP-replicated norm gains and ZeRO-1 parameters are stored once.

Protocol: the engine builds one `ParamLayout` per parameter after wrapping (`describe`), and
uses them for `state_slices`, `wanted_slices`, `load_slices` and the gradient norm. The grid
excludes pp: pipeline stages hold different parameters (but for a tied embedding's copy,
`ParamLayout.copy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainer.state_slices import TensorSlice

GRID = ("dp", "tp")


@dataclass(frozen=True)
class Geometry:
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    replica: int
    replicas: int

    @property
    def empty(self) -> bool:
        return math.prod(self.lengths) == 0

    def slice(self, name: str, dtype: torch.dtype, tensor: torch.Tensor | None = None) -> TensorSlice:
        return TensorSlice(name=name, dtype=dtype, global_shape=self.global_shape, offsets=self.offsets,
                           lengths=self.lengths, replica=self.replica, replicas=self.replicas, tensor=tensor)


@dataclass(frozen=True)
class Grid:
    """This rank's coordinates on the (dp, tp) grid and the grid's sizes."""

    coords: dict[str, int]
    sizes: dict[str, int]

    def replication(self, dims: list[str]) -> tuple[int, int]:
        """(my index, count) among the ranks that differ from me only along `dims`."""
        replica, replicas = 0, 1
        for dim in dims:
            replica = replica * self.sizes[dim] + self.coords[dim]
            replicas *= self.sizes[dim]
        return replica, replicas


def make_grid(dp_rank: int, dp_size: int, tp_rank: int, tp_size: int, dp_replicate: int = 1) -> Grid:
    """The rank's grid: (dp, tp), or (dp_replicate, dp_shard, tp) under HSDP (module docstring)."""
    if dp_replicate == 1:
        return Grid(coords={"dp": dp_rank, "tp": tp_rank}, sizes={"dp": dp_size, "tp": tp_size})
    shard_size = dp_size // dp_replicate
    replica, shard = divmod(dp_rank, shard_size)
    return Grid(coords={"dp_replicate": replica, "dp_shard": shard, "tp": tp_rank},
                sizes={"dp_replicate": dp_replicate, "dp_shard": shard_size, "tp": tp_size})


def geometry(global_shape: tuple[int, ...], spec: tuple | None, grid: Grid, replicate_over=GRID) -> Geometry:
    """Where this rank's local tensor sits in the logical one; `spec` = (mesh, placements) or None.

    `replicate_over` limits which grid dims count as replicas (ZeRO-1 optimizer state: only
    the owner along dp holds it, so dp is left out).
    """
    shape = tuple(global_shape)
    if spec is None:
        offsets, lengths, sharded = (0,) * len(shape), shape, set()
    else:
        mesh, placements = spec
        lengths, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        names = mesh.mesh_dim_names
        sharded = {names[i] for i, p in enumerate(placements) if not isinstance(p, Replicate)}
    dims = [dim for dim in grid.sizes if _counts(dim, replicate_over) and dim not in sharded]
    replica, replicas = grid.replication(dims)
    return Geometry(shape, tuple(offsets), tuple(lengths), replica, replicas)


def scalar_geometry(grid: Grid, replicate_over=GRID) -> Geometry:
    """A per-parameter scalar (AdamW's step) that every holder of the parameter's state keeps."""
    replica, replicas = grid.replication([dim for dim in grid.sizes if _counts(dim, replicate_over)])
    return Geometry((), (), (), replica, replicas)


def _counts(dim: str, replicate_over) -> bool:
    # HSDP's two data-parallel dims count wherever "dp" does
    return dim in replicate_over or (dim.startswith("dp_") and "dp" in replicate_over)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor behind a DTensor (a view: writes go to the shard); else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def dtensor_spec(tensor: torch.Tensor) -> tuple | None:
    if isinstance(tensor, DTensor):
        return tensor.device_mesh, tuple(tensor.placements)
    return None


@dataclass
class ParamLayout:
    """One parameter on this rank: its logical name and where its pieces of state sit.

    `optim` / `step` are None when this rank holds none of the parameter's optimizer state
    (ZeRO-1, another dp rank owns it). `copy` marks the last pipeline chunk's copy of a tied
    embedding: trained like the original, but neither saved nor counted in the gradient norm
    (the full model holds the tensor once).
    """

    name: str
    param: torch.nn.Parameter
    geometry: Geometry
    optim: Geometry | None
    step: Geometry | None
    copy: bool = False

    @property
    def local(self) -> torch.Tensor:
        return local(self.param)


def optimizer_fields(optimizer: str, betas: tuple[float, float]) -> list[str]:
    """Optimizer state fields per parameter, as torch's optimizers create them on the first step."""
    if optimizer == "adamw":
        return ["exp_avg", "exp_avg_sq", "step"]
    return ["momentum_buffer"] if betas[0] != 0 else []


def fresh_field(param: torch.nn.Parameter, field: str, step_on_device: bool = False) -> torch.Tensor:
    """An optimizer state field as the optimizer would create it (same type, placement, device).

    AdamW keeps `step` on the CPU in fp32, except fused or capturable AdamW
    (`trainer.optim.keeps_step_on_device`), whose kernels read it on the parameter's device."""
    if field == "step":
        return torch.zeros((), dtype=torch.float32, device=local(param).device if step_on_device else "cpu")
    return torch.zeros_like(param, memory_format=torch.preserve_format)
