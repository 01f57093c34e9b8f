"""Save a sharded state from 4 ranks, read it back in other layouts on other process counts.

Four gloo ranks (dp2 x tp2) write a synthetic state through `ShardWriter` to file://:
column- and row-parallel weights with FSDP dim-0 shards inside, an uneven split, tensors
replicated over tp (replicas=2) and over all ranks (replicas=4). Then 2 ranks (row halves),
1 rank (whole tensors) and 4 ranks (column splits) read it with `read_slices`: every value
must match bit for bit, and every rank must fetch exactly the blocks that hold its
elements, counted by wrapping `Storage.read_range`.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ckpt.boxes import intersect, row_major_strides
from ckpt.catalog import Catalog
from ckpt.manifest import ShardReceipt
from ckpt.reader import load_checkpoint, read_slices
from ckpt.storage import Storage
from ckpt.writer import ShardWriter
from tests._counting_storage import CountingStorage
from tests.dist._launch import run_ranks
from trainer.state_slices import TensorSlice

pytestmark = pytest.mark.dist

STEP = 10
BLOCK = 256  # small blocks, so the partial reads of these small tensors are visible


def logical() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model/col_w": torch.randn(32, 24, generator=g),
        "model/row_w": torch.randn(24, 32, generator=g),
        "model/emb": torch.randn(50, 16, generator=g).to(torch.bfloat16),
        "model/wide": torch.randn(8, 512, generator=g),  # 1 KiB rows per TP shard: four blocks each
        "model/norm": torch.randn(24, generator=g),
        "model/bias": torch.randn(24, generator=g),
        "optim/step": torch.tensor(7.0),
    }


def _slice(name: str, offsets: tuple, lengths: tuple, replica: int = 0, replicas: int = 1,
           data: bool = True) -> TensorSlice:
    full = logical()[name]
    index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
    return TensorSlice(name, full.dtype, tuple(full.shape), offsets, lengths, replica, replicas,
                       full[index].clone() if data else None)


def dp2_tp2(rank: int) -> list[TensorSlice]:
    d, t = divmod(rank, 2)
    return [
        _slice("model/col_w", (t * 16 + d * 8, 0), (8, 24)),  # TP rows, then FSDP rows inside
        _slice("model/row_w", (d * 12, t * 16), (12, 16)),  # TP columns, FSDP rows
        _slice("model/emb", ((0, 26)[d], t * 8), ((26, 24)[d], 8)),  # uneven rows
        _slice("model/wide", (d * 4, t * 256), (4, 256)),
        _slice("model/norm", (d * 12,), (12,), t, 2),  # FSDP shard replicated over tp
        _slice("model/bias", (0,), (24,), rank, 4),  # replicated everywhere
        _slice("optim/step", (), (), rank, 4),
    ]


def save(rank: int, world_size: int, url: str) -> dict:
    receipts, errors = [], []
    writer = ShardWriter(Storage(url), rank, lambda r, extra: receipts.append(r),
                         lambda step, err: errors.append(err), async_save=True, block_bytes=BLOCK)
    writer.save(STEP, dp2_tp2(rank), {})
    writer.flush()
    assert not errors, errors
    return receipts[0].model_dump()


def targets(layout: str, rank: int, world_size: int) -> list[TensorSlice]:
    out = []
    for name, full in logical().items():
        shape = tuple(full.shape)
        if layout == "whole" or not shape:
            out.append(_slice(name, (0,) * len(shape), shape, data=False))
            continue
        dim = 0 if layout == "rows" else len(shape) - 1
        step = -(-shape[dim] // world_size)  # uneven where the size does not divide
        start = min(rank * step, shape[dim])
        offsets, lengths = [0] * len(shape), list(shape)
        offsets[dim], lengths[dim] = start, min(step, shape[dim] - start)
        out.append(_slice(name, tuple(offsets), tuple(lengths), data=False))
    return out


def load(rank: int, world_size: int, url: str, layout: str) -> tuple[list, list]:
    storage = CountingStorage(url)
    got = read_slices(Catalog(storage), STEP, targets(layout, rank, world_size), coalesce_gap=0)
    return [(piece.key, piece.tensor) for piece in got], storage.reads


def needed_blocks(manifest, wanted: list[TensorSlice]) -> set[tuple[str, int]]:
    """(file, block start) of every block holding an element of `wanted`, element by element."""
    out = set()
    for piece in wanted:
        entry = manifest.tensors[piece.name]
        size = torch.empty((), dtype=piece.dtype).element_size()
        for chunk in entry.chunks:
            common = intersect(piece.offsets, piece.lengths, chunk.offsets, chunk.lengths)
            if common is None:
                continue
            strides = row_major_strides(chunk.lengths)
            for element in itertools.product(*(range(o, o + n) for o, n in zip(*common, strict=True))):
                rel = np.subtract(element, chunk.offsets) if element else ()
                pos = int(sum(r * s for r, s in zip(rel, strides, strict=True))) * size
                out.add((chunk.file, chunk.byte_offset + pos // chunk.block_bytes * chunk.block_bytes))
    return out


def read_blocks(manifest, reads: list[tuple[str, int, int]]) -> set[tuple[str, int]]:
    """(file, block start) of every block a rank's range reads fetched."""
    starts = {(c.file, c.byte_offset + i * c.block_bytes): c.byte_offset + min((i + 1) * c.block_bytes, c.nbytes)
              for e in manifest.tensors.values() for c in e.chunks for i in range(len(c.block_crc32))}
    out = set()
    for file, start, end in reads:
        inside = {(f, s) for (f, s), stop in starts.items() if f == file and start <= s and stop <= end}
        assert sum(starts[b] - b[1] for b in inside) == end - start  # reads are whole blocks, nothing else
        out |= inside
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    url = f"file://{tmp_path_factory.mktemp('ckpt')}/job"
    receipts = [ShardReceipt.model_validate(r) for r in run_ranks(save, 4, (url,))]
    catalog = Catalog(Storage(url))
    manifest = catalog.commit(job="j", step=STEP, generation=0, layout={"dp": 2, "tp": 2}, spec_hash="h",
                              receipts=receipts, state={"engine": {"next_step": STEP}})
    return url, manifest


def test_replicated_slices_are_stored_once(saved):
    _, manifest = saved
    assert len(manifest.tensors["model/bias"].chunks) == 1
    assert [c.offsets for c in manifest.tensors["model/norm"].chunks] == [[0], [12]]
    assert len({c.file for c in manifest.tensors["model/col_w"].chunks}) == 4


@pytest.mark.parametrize(("layout", "world_size"), [("rows", 2), ("whole", 1), ("columns", 4)])
def test_other_layouts_read_back_bit_exact_fetching_only_their_blocks(saved, layout, world_size):
    url, manifest = saved
    reference = logical()
    total = sum(c.nbytes for e in manifest.tensors.values() for c in e.chunks)
    ranks = run_ranks(load, world_size, (url, layout))
    seen = []
    for rank, (pieces, reads) in enumerate(ranks):
        for (name, offsets, lengths), tensor in pieces:
            index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
            assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name][index]), name
            seen.append((name, offsets, lengths))
        wanted = targets(layout, rank, world_size)
        assert read_blocks(manifest, reads) == needed_blocks(manifest, wanted)
        if world_size > 1:
            assert sum(end - start for _, start, end in reads) < total * 0.6  # measured: 40 to 51 %
    for name, full in reference.items():  # the layout's slices cover every tensor
        assert sum(int(np.prod(n)) for nm, _, n in seen if nm == name) >= full.numel()


def test_one_process_loads_whole_tensors(saved):
    url, _ = saved
    tensors, manifest = load_checkpoint(Catalog(Storage(url)), STEP)
    assert manifest.state["engine"] == {"next_step": STEP}
    for name, full in logical().items():
        assert torch.equal(tensors[name], full), name
