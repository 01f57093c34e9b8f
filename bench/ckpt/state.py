"""The state that bench.ckpt saves and loads: a GPT-like stack of Linear layers under FSDP2.

Every rank of a 4-process gloo group builds the same model (same seed), wraps each Linear
and the root with `fully_shard` on a 1-D "dp" mesh, runs one forward/backward and one
AdamW step, so the state is params + exp_avg + exp_avg_sq (+ AdamW's scalar `step`), each
sharded by rows over the 4 ranks. The same live tensors are then described three ways:

  * `our_slices`: `TensorSlice`s of the rank's local shards, geometry from
    trainer.dtensor_slices (offsets into the logical tensors, the replicated `step` scalar
    with replicas = world size); the tensors are the live shards, not copies, so staging
    is the writer's copy alone;
  * `dcp_state`: the same DTensors (and plain `step` tensors) under the same logical names,
    the flat state dict handed to torch.distributed.checkpoint;
  * `layout_slices` / `dcp_targets`: what a rank wants in another layout, for the load
    measurements: "dp4" (the saving layout), "dp2" (ranks 0 and 1 hold row halves, ranks
    2 and 3 nothing) and "tp4" (every 2-D weight split by columns over 4 ranks, biases and
    scalars whole on every rank, as row-parallel tensor parallelism holds them).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from trainer.dtensor_slices import Grid, dtensor_spec, geometry, local, scalar_geometry
from trainer.state_slices import TensorSlice

FIELDS = ("exp_avg", "exp_avg_sq")
LAYOUTS = ("dp4", "dp2", "tp4")


def layer_count(size_bytes: int, width: int) -> int:
    """Linear layers (alternating width -> 4 width -> width) whose params + 2 moments reach `size_bytes`."""
    per_layer = (4 * width * width + 4 * width) * 4 * 3  # fp32 params + exp_avg + exp_avg_sq
    return max(2, math.ceil(size_bytes / per_layer))


class Stack(torch.nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        dims = [(width, 4 * width) if i % 2 == 0 else (4 * width, width) for i in range(layers)]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i % 2 == 0:
                x = torch.nn.functional.gelu(x)
        return x


class BenchState:
    """The model, its optimizer after one step, and the views of its state the bench needs."""

    def __init__(self, size_bytes: int, width: int, seed: int = 0):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh("cpu", (self.world,), mesh_dim_names=("dp",))
        torch.manual_seed(seed)  # identical full weights on every rank before sharding
        self.model = Stack(width, layer_count(size_bytes, width))
        for layer in self.model.layers:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(seed + 1))
        self.model(x).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.params = dict(self.model.named_parameters())
        self.grid = Grid(coords={"dp": self.rank, "tp": 0}, sizes={"dp": self.world, "tp": 1})
        # Built on every rank: creating a sub-mesh creates a process group, a collective.
        self.pair_mesh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",))

    # -- what is saved ---------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """Logical name -> the live DTensor (or plain scalar tensor) holding it."""
        out = {}
        for name, param in self.params.items():
            out[f"model/{name}"] = param
            state = self.optimizer.state[param]
            for field in FIELDS:
                out[f"optim/{name}/{field}"] = state[field]
            out[f"optim/{name}/step"] = state["step"]
        return out

    def our_slices(self) -> list[TensorSlice]:
        out = []
        for name, value in self.tensors().items():
            if value.dim() == 0:
                where = scalar_geometry(self.grid)
            else:
                where = geometry(tuple(value.shape), dtensor_spec(value), self.grid)
            out.append(where.slice(name, value.dtype, local(value).detach()))
        return out

    def dcp_state(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors())

    def total_bytes(self) -> int:
        """Bytes of the logical state (each tensor once), what a checkpoint must hold."""
        return sum(v.numel() * v.element_size() for v in self.tensors().values())

    # -- what a loading layout wants ---------------------------------------------------------

    def layout_slices(self, layout: str) -> list[TensorSlice]:
        """This rank's wanted slices (geometry only) in `layout`; empty when it holds nothing there."""
        if layout == "dp2" and self.rank >= 2:
            return []
        out = []
        for name, value in self.tensors().items():
            shape = tuple(value.shape)
            offsets, lengths = _box(shape, layout, self.rank, self.world)
            out.append(TensorSlice(name, value.dtype, shape, offsets, lengths))
        return out

    def dcp_targets(self, layout: str) -> dict[str, torch.Tensor]:
        """A fresh, zeroed state dict for `dcp.load` in `layout` (DTensors on the layout's mesh)."""
        if layout == "dp2" and self.rank >= 2:
            return {}
        mesh = self.pair_mesh if layout == "dp2" else self.mesh
        out = {}
        for name, value in self.tensors().items():
            shape = tuple(value.shape)
            if value.dim() == 0:
                out[name] = torch.zeros((), dtype=value.dtype)
                continue
            placement = _placement(shape, layout)
            _, lengths = _box(shape, layout, self.rank, self.world)
            out[name] = DTensor.from_local(torch.zeros(lengths, dtype=value.dtype), mesh, [placement],
                                           run_check=False, shape=torch.Size(shape),
                                           stride=_contiguous_strides(shape))
        return out

    def check_loaded(self, loaded: dict[str, torch.Tensor], layout: str) -> int:
        """Bit-compare loaded local tensors against the logical state; returns the tensors checked.

        A collective per tensor (`full_tensor`), so every rank calls it, also those that
        loaded nothing in `layout`; run outside any timed region.
        """
        checked = 0
        for name, value in self.tensors().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if name not in loaded:
                continue
            got = local(loaded[name])
            offsets, lengths = _box(tuple(value.shape), layout, self.rank, self.world)
            want = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
            if not torch.equal(_bits(got), _bits(want)):
                raise AssertionError(f"rank {self.rank}, layout {layout}: {name} differs from the saved state")
            checked += 1
        return checked


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor: equal bits, not equal values (-0.0 == 0.0, NaN != NaN)."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def _placement(shape: tuple[int, ...], layout: str):
    if layout == "tp4":
        return Shard(1) if len(shape) == 2 else Replicate()
    return Shard(0)


def _box(shape: tuple[int, ...], layout: str, rank: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, lengths) of this rank's piece of a logical tensor of `shape` in `layout`."""
    if not shape:
        return (), ()
    parts, dim = {"dp4": (world, 0), "dp2": (2, 0), "tp4": (world, 1)}[layout]
    if dim >= len(shape):  # 1-D biases under tp4: whole on every rank
        return (0,) * len(shape), shape
    # torch's Shard(dim) split: ceil-sized pieces, the last ones short or empty.
    step = -(-shape[dim] // parts)
    lo, hi = min(rank * step, shape[dim]), min((rank + 1) * step, shape[dim])
    offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
    lengths = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
    return offsets, lengths


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))
