"""The rank grid of a 3D-parallel job: which (dp, pp, tp) coordinates each global rank holds.

TP varies fastest, then PP, then DP (the same mapping the cost model prices, see
`trainer.costmodel.layout`):

    rank = (dp_index * pp + pp_index) * tp + tp_index

so a TP group is `tp` consecutive ranks (inside one node whenever tp <= GPUs per node: TP
sends activations every layer and needs the fastest link), a PP group strides by `tp`
(point-to-point activations once per microbatch and stage), and a DP group strides by
`tp * pp` (one gradient reduction per step, the easiest traffic to hide). Example, dp=2 pp=2 tp=2:

    rank: 0 1 2 3 4 5 6 7
    dp:   0 0 0 0 1 1 1 1
    pp:   0 0 1 1 0 0 1 1
    tp:   0 1 0 1 0 1 0 1

`Topology` is pure arithmetic (unit-tested without processes). `build_mesh` turns it into a
torch DeviceMesh with dims named ("dp", "pp", "tp") in that order, whose sub-meshes
(`mesh["tp"]`, ...) are the process groups each parallelism uses; every rank of the default
process group must call it, in the same order, because creating sub-groups is collective.

HSDP (`dp_replicate` R > 1, as TorchTitan lays it out): the dp index splits into
(replica, shard) = divmod(dp_index, dp / R), so one replica is dp / R consecutive dp indices
(contiguous ranks: placed on as few nodes as its bundles allow, and its shard group, which
gathers weights every microbatch, is the group that stays close). The mesh then has dims
("dp_replicate", "dp_shard", "pp", "tp") with the first two also flattened into "dp", so
`mesh["dp"]` is still the whole data-parallel group (batch split, loss, DDP-free token
counts) and FSDP2 shards over `fsdp_mesh` = mesh["dp_replicate", "dp_shard"].
"""

from __future__ import annotations

from dataclasses import dataclass

MESH_DIMS = ("dp", "pp", "tp")
HSDP_DIMS = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class Coords:
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Topology:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    dp_replicate: int = 1

    @classmethod
    def of(cls, parallel) -> Topology:
        """The topology of a `ParallelConfig`."""
        return cls(dp=parallel.dp, pp=parallel.pp, tp=parallel.tp, dp_replicate=parallel.dp_replicate)

    def __post_init__(self) -> None:
        for dim in (*MESH_DIMS, "dp_replicate"):
            value = getattr(self, dim)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{dim}={value!r}: every degree must be a positive integer")
        if self.dp % self.dp_replicate:
            raise ValueError(f"parallel.dp_replicate={self.dp_replicate} does not divide parallel.dp={self.dp}")

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    def replica_of(self, dp_index: int) -> tuple[int, int]:
        """(replica, index inside the replica's shard group) of a dp index (HSDP)."""
        return divmod(dp_index, self.dp_shard)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in MESH_DIMS order."""
        return (self.dp, self.pp, self.tp)

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"parallel.dp*pp*tp = {self.dp}*{self.pp}*{self.tp} = {self.world_size} but the "
                f"process group has {world_size} ranks: make the product equal the number of ranks"
            )

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        tp_index = rank % self.tp
        pp_index = (rank // self.tp) % self.pp
        dp_index = rank // (self.tp * self.pp)
        return Coords(dp=dp_index, pp=pp_index, tp=tp_index)

    def rank_of(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        for dim, index in (("dp", dp), ("pp", pp), ("tp", tp)):
            if not 0 <= index < getattr(self, dim):
                raise ValueError(f"{dim} index {index} is outside 0..{getattr(self, dim) - 1}")
        return (dp * self.pp + pp) * self.tp + tp

    def group_of(self, rank: int, dim: str) -> list[int]:
        """The global ranks that share every coordinate with `rank` except `dim`, in order."""
        if dim not in MESH_DIMS:
            raise ValueError(f"unknown mesh dim {dim!r}; expected one of {MESH_DIMS}")
        here = self.coords(rank)
        members = []
        for index in range(getattr(self, dim)):
            where = {"dp": here.dp, "pp": here.pp, "tp": here.tp, dim: index}
            members.append(self.rank_of(**where))
        return members

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along `dim` (each rank in exactly one), sorted by first member."""
        seen: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            group = self.group_of(rank, dim)
            seen.setdefault(group[0], group)
        return [seen[first] for first in sorted(seen)]


def build_mesh(topology: Topology, device_type: str = "cpu", timeout_s: float | None = None):
    """The torch DeviceMesh of `topology` over the default process group (collective).

    The mesh tensor is `arange(world).reshape(dp, pp, tp)`, which is exactly the mapping
    above, so `mesh[dim]` groups agree with `Topology.group_of`. `timeout_s`: its groups' timeout,
    their creation's included (the job's collective timeout; None: torch's default, 30 minutes on
    gloo and 10 on NCCL, which a sub-group would otherwise take whatever the default group's is).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    topology.check_world(dist.get_world_size())
    ranks = torch.arange(topology.world_size)
    hsdp = topology.dp_replicate > 1
    shape = (topology.dp_replicate, topology.dp_shard, topology.pp, topology.tp) if hsdp else topology.shape
    options = None if timeout_s is None else _group_options(device_type, timeout_s)

    def override(size: int) -> tuple:  # a dimension over the whole world is the default group, which has it
        return (None, None) if options is None or size == topology.world_size else (None, options)

    mesh = DeviceMesh(device_type, ranks.reshape(shape), mesh_dim_names=HSDP_DIMS + MESH_DIMS[1:] if hsdp else
                      MESH_DIMS, backend_override=tuple(override(size) for size in shape))
    if hsdp:
        flat = override(topology.dp_replicate * topology.dp_shard)
        mesh[HSDP_DIMS]._flatten("dp", backend_override=None if flat == (None, None) else flat)
    return mesh


def _group_options(device_type: str, timeout_s: float):
    """Process-group options that carry `timeout_s` (DeviceMesh passes a group's timeout in them)."""
    from datetime import timedelta

    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options() if device_type == "cuda" else dist.ProcessGroupGloo._Options()
    if device_type == "cuda":
        options.is_high_priority_stream = False  # as torch's own default options for NCCL
    options._timeout = timedelta(seconds=timeout_s)
    return options


def fsdp_mesh(mesh, dp_replicate: int):
    """The mesh FSDP2 shards over: mesh["dp"], or the 2-D (replicate, shard) mesh of HSDP."""
    return mesh[HSDP_DIMS] if dp_replicate > 1 else mesh["dp"]
