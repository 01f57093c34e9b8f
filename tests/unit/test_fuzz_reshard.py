"""Fuzz resharding: tensors of random shapes and dtypes, saved by the real writer in one random
rectangular layout over random ranks and committed, load bit for bit into any other layout
(ckpt.reshard plans the reads, ckpt.reader fetches, verifies and assembles them)."""

from __future__ import annotations

import itertools
import tempfile

import torch
from hypothesis import given
from hypothesis import strategies as st

from ckpt.catalog import Catalog
from ckpt.reader import read_slices
from ckpt.shards import write_slices
from ckpt.storage import Storage
from tests._fuzz import fuzz
from trainer.state_slices import TensorSlice

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8]


@st.composite
def grid(draw, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A random rectangular partition of `shape`: cut points per dimension, every cell a box."""
    bounds = []
    for size in shape:
        cuts = sorted(draw(st.sets(st.integers(1, size - 1), max_size=3))) if size > 1 else []
        edges = [0, *cuts, size]
        bounds.append(list(zip(edges, edges[1:], strict=False)))
    return [(tuple(a for a, _ in cell), tuple(b - a for a, b in cell)) for cell in itertools.product(*bounds)]


@st.composite
def tensors(draw) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 7), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        values = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
        out[f"t{i}"] = (values * 100).to(dtype)
    return out


@st.composite
def case(draw):
    state = draw(tensors())
    world = draw(st.integers(1, 3))
    saved = {name: [(box, draw(st.integers(0, world - 1))) for box in draw(grid(tuple(t.shape)))]
             for name, t in state.items()}
    loaded = {name: draw(grid(tuple(t.shape))) for name, t in state.items()}
    knobs = {"block_bytes": draw(st.sampled_from([64, 128, 4096])), "min_tile_bytes": draw(st.sampled_from([8, 64])),
             "coalesce_gap": draw(st.sampled_from([0, 100, 1 << 20]))}
    return state, world, saved, loaded, knobs


def _slice(name: str, t: torch.Tensor, offsets: tuple, lengths: tuple, data: bool) -> TensorSlice:
    region = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
    return TensorSlice(name, t.dtype, tuple(t.shape), offsets, lengths,
                       tensor=t[region].clone() if data else None)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@fuzz(100)
@given(case())
def test_any_saved_layout_loads_into_any_other_bit_for_bit(example):
    state, world, saved, loaded, knobs = example
    with tempfile.TemporaryDirectory() as tmp:
        catalog = Catalog(Storage(f"file://{tmp}/job"))
        receipts = []
        for rank in range(world):
            mine = [_slice(n, state[n], off, ln, True) for n, boxes in saved.items()
                    for (off, ln), r in boxes if r == rank]
            receipts.append(write_slices(catalog.storage, 5, rank, mine, 0.0, block_bytes=knobs["block_bytes"],
                                         min_tile_bytes=knobs["min_tile_bytes"]))
        catalog.commit(job="j", step=5, generation=0, layout={"dp": world}, spec_hash="h", receipts=receipts,
                       state={})
        wanted = [_slice(n, state[n], off, ln, False) for n, boxes in loaded.items() for off, ln in boxes]
        got = read_slices(catalog, 5, wanted, coalesce_gap=knobs["coalesce_gap"], threads=2)
    rebuilt = {n: torch.zeros_like(t) for n, t in state.items()}
    for piece in got:
        assert piece.tensor.dtype == piece.dtype and tuple(piece.tensor.shape) == piece.lengths
        rebuilt[piece.name][tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.lengths, strict=True))] = \
            piece.tensor
    for name, t in state.items():
        assert _raw(rebuilt[name]) == _raw(t), name
