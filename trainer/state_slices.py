"""The engine's training state as rectangular slices of named logical tensors (docs/design.md invariant 2).

Whatever the layout (DDP replicas, ZeRO shards, TP column/row splits, PP stages), every
tensor a rank holds for its training state is described as a slice of one *logical*,
unsharded tensor with a stable name:

    model/<param name>             parameters (names of `trainer.model`, e.g. blocks.3.attn.q_proj.weight)
    optim/<param name>/<field>     optimizer state (AdamW: exp_avg, exp_avg_sq, step; SGD: momentum_buffer)

A slice is (offsets, lengths) into the logical tensor's global shape: row-major, one
rectangle, `lengths` equal to the local tensor's shape. Ranks that hold the identical
slice (DP replicas) each report it with `replica` = their index among the `replicas` ranks
that hold it, so a writer can store it once and spread the writing evenly.

Protocol (engine <-> checkpoint library):
  * save: `engine.state_slices()` returns CPU copies (`tensor` set), safe to write in the
    background while training continues; `engine.state_meta()` the JSON-able rest.
  * load: `engine.wanted_slices()` returns the same geometry without data (`tensor` None),
    including optimizer state that does not exist yet before the first step; the caller
    reads each one from storage (any stored layout) and passes them to
    `engine.load_slices(slices, meta)`, which copies them in. Local, no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class TensorSlice:
    name: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    replica: int = 0
    replicas: int = 1
    tensor: torch.Tensor | None = None

    def __post_init__(self) -> None:
        dims = len(self.global_shape)
        if len(self.offsets) != dims or len(self.lengths) != dims:
            raise ValueError(f"{self.name}: offsets/lengths must have {dims} entries, one per dimension")
        for dim, (start, length, size) in enumerate(zip(self.offsets, self.lengths, self.global_shape, strict=True)):
            if start < 0 or length < 0 or start + length > size:
                raise ValueError(
                    f"{self.name}: slice [{start}, {start + length}) of dim {dim} is outside 0..{size}"
                )
        if not 0 <= self.replica < self.replicas:
            raise ValueError(f"{self.name}: replica {self.replica} is outside 0..{self.replicas - 1}")
        if self.tensor is not None and tuple(self.tensor.shape) != tuple(self.lengths):
            raise ValueError(
                f"{self.name}: tensor shape {tuple(self.tensor.shape)} does not match lengths {self.lengths}"
            )

    @property
    def key(self) -> tuple:
        """Identifies the slice's geometry: equal keys mean the same elements of the same tensor."""
        return (self.name, self.offsets, self.lengths)

    @property
    def numel(self) -> int:
        count = 1
        for length in self.lengths:
            count *= length
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def index(self) -> tuple[slice, ...]:
        """Indexing expression of this slice inside the logical tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths, strict=True))

    def with_tensor(self, tensor: torch.Tensor | None) -> TensorSlice:
        return replace(self, tensor=tensor)


def whole(name: str, tensor: torch.Tensor, replica: int = 0, replicas: int = 1) -> TensorSlice:
    """A slice covering all of `tensor` (a replicated or unsharded tensor)."""
    shape = tuple(tensor.shape)
    return TensorSlice(
        name=name, dtype=tensor.dtype, global_shape=shape, offsets=(0,) * len(shape), lengths=shape,
        replica=replica, replicas=replicas, tensor=tensor,
    )


def assemble(slices: list[TensorSlice]) -> dict[str, torch.Tensor]:
    """Logical tensors rebuilt from slices that together cover them (tests, export, one process).

    Raises ValueError if a tensor is not fully covered.
    """
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for piece in slices:
        if piece.tensor is None:
            raise ValueError(f"{piece.name}: slice has no data")
        if piece.name not in out:
            out[piece.name] = torch.empty(piece.global_shape, dtype=piece.dtype)
            covered[piece.name] = torch.zeros(piece.global_shape, dtype=torch.bool)
        out[piece.name][piece.index()] = piece.tensor
        covered[piece.name][piece.index()] = True
    for name, mask in covered.items():
        if not bool(mask.all()):
            raise ValueError(f"{name}: slices cover {int(mask.sum())} of {mask.numel()} elements")
    return out
