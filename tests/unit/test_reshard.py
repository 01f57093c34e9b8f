"""Load-time resharding planned on manifests alone (no processes, no I/O).

Stored layouts are built as the writer lays shards out (chunks back to back, ALIGN-aligned,
fixed-size blocks); every plan is checked against brute force, element by element: the
blocks it fetches are exactly the blocks holding a wanted element, and replaying its copies
on the logical tensors rebuilds every target slice.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from ckpt.blocks import ALIGN, block_count, touched_blocks
from ckpt.boxes import row_major_strides, volume
from ckpt.manifest import Chunk, TensorEntry
from ckpt.reshard import CoverageError, plan_reads
from trainer.state_slices import TensorSlice

DTYPES = {"col_w": torch.float32, "row_w": torch.float32, "norm": torch.float32, "step": torch.float32,
          "emb": torch.bfloat16, "cube": torch.float64}
SHAPES = {"col_w": (16, 12), "row_w": (16, 12), "norm": (12,), "step": (), "emb": (10, 7), "cube": (4, 6, 5)}


def _itemsize(name: str) -> int:
    return torch.empty((), dtype=DTYPES[name]).element_size()


def stored(pieces: dict[int, list[tuple[str, tuple, tuple]]], block_bytes: int) -> dict[str, TensorEntry]:
    """Manifest entries for `rank -> [(tensor, offsets, lengths)]`, laid out as the shard writer does."""
    entries = {name: TensorEntry(dtype=str(DTYPES[name]).removeprefix("torch."), shape=list(SHAPES[name]))
               for name in SHAPES}
    for rank, chunks in pieces.items():
        offset = 0
        for name, offsets, lengths in sorted(chunks):
            offset += -offset % ALIGN
            nbytes = volume(lengths) * _itemsize(name)
            entries[name].chunks.append(Chunk(
                offsets=list(offsets), lengths=list(lengths), file=f"shard-r{rank:05d}.bin", byte_offset=offset,
                nbytes=nbytes, block_bytes=block_bytes, block_crc32=[0] * block_count(nbytes, block_bytes)))
            offset += nbytes
    return entries


def target(name: str, offsets: tuple, lengths: tuple) -> TensorSlice:
    return TensorSlice(name=name, dtype=DTYPES[name], global_shape=SHAPES[name], offsets=offsets, lengths=lengths)


def whole_targets() -> list[TensorSlice]:
    return [target(n, (0,) * len(s), s) for n, s in SHAPES.items()]


def dp2_tp2() -> dict[int, list]:
    """FSDP dim-0 shards inside TP shards, as FSDP2 x TP lays out a transformer's weights."""
    out = {}
    for rank in range(4):
        d, t = divmod(rank, 2)
        pieces = [
            ("col_w", (t * 8 + d * 4, 0), (4, 12)),  # ColwiseParallel: TP splits dim 0, FSDP splits it again
            ("row_w", (d * 8, t * 6), (8, 6)),  # RowwiseParallel: TP splits dim 1, FSDP splits dim 0
            ("emb", ((0, 6)[d], (0, 4)[t]), ((6, 4)[d], (4, 3)[t])),  # uneven in both dimensions
            ("cube", (0, d * 3, (0, 3)[t]), (4, 3, (3, 2)[t])),  # 3-D, split along its last two dimensions
        ]
        if t == 0:  # replicated over tp (replicas=2): one of the two writes it
            pieces.append(("norm", (d * 6,), (6,)))
        if rank == 3:  # replicated everywhere
            pieces.append(("step", (), ()))
        out[rank] = pieces
    return out


def tp4(rank: int) -> list[TensorSlice]:
    cols = [(0, 2), (2, 2), (4, 2), (6, 1)]
    return [target("col_w", (rank * 4, 0), (4, 12)), target("row_w", (0, rank * 3), (16, 3)),
            target("emb", (0, cols[rank][0]), (10, cols[rank][1])), target("norm", (0,), (12,)),
            target("step", (), ()), target("cube", (0, 0, 0), (4, 6, 5))]


def dp4(rank: int) -> list[TensorSlice]:
    rows = [(0, 3), (3, 3), (6, 2), (8, 2)]
    return [target("col_w", (rank * 4, 0), (4, 12)), target("row_w", (rank * 4, 0), (4, 12)),
            target("emb", (rows[rank][0], 0), (rows[rank][1], 7)), target("norm", (rank * 3,), (3,)),
            target("step", (), ()), target("cube", (rank, 0, 0), (1, 6, 5))]


def _boxes(chunk_or_slice) -> tuple[tuple, tuple]:
    return tuple(chunk_or_slice.offsets), tuple(chunk_or_slice.lengths)


def brute_force_blocks(entries: dict[str, TensorEntry], targets: list[TensorSlice]) -> set[tuple[str, int, int]]:
    """(file, block start, block end) of every block holding at least one element some target wants."""
    out = set()
    for t in targets:
        entry, size = entries[t.name], _itemsize(t.name)
        for element in itertools.product(*(range(o, o + n) for o, n in zip(t.offsets, t.lengths, strict=True))):
            holders = [c for c in entry.chunks
                       if all(o <= e < o + n for e, o, n in zip(element, c.offsets, c.lengths, strict=True))]
            assert len(holders) == 1, (t.name, element)
            chunk = holders[0]
            rel = [e - o for e, o in zip(element, chunk.offsets, strict=True)]
            pos = sum(r * s for r, s in zip(rel, row_major_strides(chunk.lengths), strict=True)) * size
            for block in {pos // chunk.block_bytes, (pos + size - 1) // chunk.block_bytes}:
                start = chunk.byte_offset + block * chunk.block_bytes
                out.add((chunk.file, start, min(start + chunk.block_bytes, chunk.byte_offset + chunk.nbytes)))
    return out


def replay(plan, entries: dict[str, TensorEntry], targets: list[TensorSlice]) -> list[torch.Tensor]:
    """Execute the plan's copies on the logical tensors, checking each source byte was fetched."""
    logical = {n: torch.arange(volume(s), dtype=torch.float64).reshape(s) for n, s in SHAPES.items()}
    fetched = {(r.file, b.start, b.end) for r in plan.reads for b in r.blocks}
    for read in plan.reads:
        assert all(read.start <= b.start < b.end <= read.end for b in read.blocks)
    out = [torch.full(t.lengths, -1.0, dtype=torch.float64) for t in targets]
    for copy in plan.copies:
        t = targets[copy.target]
        chunk = next(c for c in entries[t.name].chunks
                     if c.file == copy.file and c.byte_offset == copy.chunk_start)
        source = logical[t.name][tuple(slice(o, o + n) for o, n in _zip(chunk))]
        src = tuple(slice(o, o + n) for o, n in zip(copy.src_offsets, copy.lengths, strict=True))
        dst = tuple(slice(o, o + n) for o, n in zip(copy.dst_offsets, copy.lengths, strict=True))
        out[copy.target][dst] = source[src]
        for block in touched_blocks(chunk.lengths, _itemsize(t.name), copy.src_offsets, copy.lengths,
                                    chunk.block_bytes):
            for i in range(*block):
                start = chunk.byte_offset + i * chunk.block_bytes
                assert (chunk.file, start, min(start + chunk.block_bytes, chunk.byte_offset + chunk.nbytes)) in fetched
    for t, got in zip(targets, out, strict=True):
        want = logical[t.name][tuple(slice(o, o + n) for o, n in zip(t.offsets, t.lengths, strict=True))]
        assert torch.equal(got, want), t.name
    return out


def _zip(chunk):
    return zip(chunk.offsets, chunk.lengths, strict=True)


@pytest.mark.parametrize("block_bytes", [64, 128, 1 << 20])
@pytest.mark.parametrize("layout", ["tp4", "dp4", "one process"])
def test_dp2_tp2_loads_into_other_layouts_reading_exactly_the_needed_blocks(layout, block_bytes):
    entries = stored(dp2_tp2(), block_bytes)
    ranks = {"tp4": [tp4(r) for r in range(4)], "dp4": [dp4(r) for r in range(4)],
             "one process": [whole_targets()]}[layout]
    total = sum(c.nbytes for e in entries.values() for c in e.chunks)
    for targets in ranks:
        plan = plan_reads(entries, targets, coalesce_gap=0)
        replay(plan, entries, targets)
        expected = brute_force_blocks(entries, targets)
        assert {(r.file, b.start, b.end) for r in plan.reads for b in r.blocks} == expected
        assert plan.bytes_to_read == sum(end - start for _, start, end in expected)
        if layout != "one process" and block_bytes == 64:
            assert plan.bytes_to_read < total * 0.7  # small blocks: each of four ranks skips much of the state


def test_column_slice_of_a_row_major_chunk_reads_only_its_blocks_of_each_row():
    # One chunk [16, 1024] float32: a row is 4 KiB, four 1 KiB blocks.
    entries = {"big": TensorEntry(dtype="float32", shape=[16, 2048], chunks=[
        Chunk(offsets=[0, 0], lengths=[16, 1024], file="a", byte_offset=0, nbytes=65536,
              block_bytes=1024, block_crc32=[0] * 64),
        Chunk(offsets=[0, 1024], lengths=[16, 1024], file="a", byte_offset=65536, nbytes=65536,
              block_bytes=1024, block_crc32=[0] * 64)])}
    column = TensorSlice("big", torch.float32, (16, 2048), (0, 0), (16, 256))  # the first 1 KiB of each row
    apart = plan_reads(entries, [column], coalesce_gap=0)
    assert [(r.start, r.end) for r in apart.reads] == [(row * 4096, row * 4096 + 1024) for row in range(16)]
    merged = plan_reads(entries, [column], coalesce_gap=4096)
    assert [(r.start, r.end) for r in merged.reads] == [(0, 15 * 4096 + 1024)]
    assert len(merged.reads[0].blocks) == 16  # only the needed blocks are verified
    rows = TensorSlice("big", torch.float32, (16, 2048), (4, 1024), (4, 1024))  # rows 4..7 of the second chunk
    plan = plan_reads(entries, [rows], coalesce_gap=0)
    assert [(r.file, r.start, r.end) for r in plan.reads] == [("a", 65536 + 4 * 4096, 65536 + 8 * 4096)]
    straddle = TensorSlice("big", torch.float32, (16, 2048), (2, 1000), (1, 48))  # crosses the chunk boundary
    plan = plan_reads(entries, [straddle], coalesce_gap=0)
    assert [(r.start, r.end) for r in plan.reads] == [(2 * 4096 + 3072, 2 * 4096 + 4096),
                                                      (65536 + 2 * 4096, 65536 + 2 * 4096 + 1024)]
    assert [(c.src_offsets, c.dst_offsets, c.lengths) for c in plan.copies] == [
        ((2, 1000), (0, 0), (1, 24)), ((2, 0), (0, 24), (1, 24))]


def test_ranges_are_capped_so_large_reads_spread_over_threads():
    entries = {"big": TensorEntry(dtype="uint8", shape=[10 * 1024], chunks=[Chunk(
        offsets=[0], lengths=[10 * 1024], file="a", byte_offset=0, nbytes=10 * 1024, block_bytes=1024,
        block_crc32=[0] * 10)])}
    plan = plan_reads(entries, [TensorSlice("big", torch.uint8, (10240,), (0,), (10240,))], max_range=4096)
    assert [(r.start, r.end) for r in plan.reads] == [(0, 4096), (4096, 8192), (8192, 10240)]


def test_touched_blocks_matches_brute_force_on_random_boxes():
    rng = random.Random(7)
    for _ in range(400):
        ndim = rng.randrange(0, 5)
        shape = tuple(rng.randrange(1, 9) for _ in range(ndim))
        offsets = tuple(rng.randrange(0, s) for s in shape)
        lengths = tuple(rng.randrange(1, s - o + 1) for s, o in zip(shape, offsets, strict=True))
        size, block = rng.choice([1, 2, 4, 8]), rng.choice([64, 128, 192, 1024])
        strides = row_major_strides(shape)
        want = set()
        for element in itertools.product(*(range(o, o + n) for o, n in zip(offsets, lengths, strict=True))):
            pos = sum(e * s for e, s in zip(element, strides, strict=True)) * size
            want.update(range(pos // block, (pos + size - 1) // block + 1))
        got = touched_blocks(shape, size, offsets, lengths, block)
        assert all(a < b for a, b in got) and all(got[i][1] < got[i + 1][0] for i in range(len(got) - 1))
        assert {i for a, b in got for i in range(a, b)} == want, (shape, offsets, lengths, size, block)


def test_touched_blocks_of_a_large_strided_box_is_vectorised():
    # 200k rows of 1 KiB; every 4th block holds a wanted column: enumerated with numpy, not Python loops.
    got = touched_blocks((200_000, 256), 4, (0, 0), (200_000, 16), 256)
    assert len(got) == 200_000 and got[:2] == [(0, 1), (4, 5)]
    assert touched_blocks((200_000, 256), 4, (0, 0), (200_000, 16), 2048) == [(0, 100_000)]  # gaps < a block


def test_incomplete_coverage_names_the_tensor():
    pieces = dp2_tp2()
    pieces[2] = [p for p in pieces[2] if p[0] != "row_w"]
    entries = stored(pieces, 64)
    with pytest.raises(CoverageError, match="row_w: the stored chunks cover 144 of the 192 elements"):
        plan_reads(entries, whole_targets())
    plan_reads(entries, [target("row_w", (0, 0), (8, 12))])  # the rows that are stored still load


def test_missing_tensor_and_wrong_shape_are_refused_by_name():
    entries = stored(dp2_tp2(), 64)
    with pytest.raises(ValueError, match="nope: the checkpoint has no such tensor"):
        plan_reads(entries, [TensorSlice("nope", torch.float32, (2,), (0,), (2,))])
    with pytest.raises(ValueError, match=r"norm: stored with global shape \[12\], the layout wants \[13\]"):
        plan_reads(entries, [TensorSlice("norm", torch.float32, (13,), (0,), (13,))])


def test_empty_targets_need_no_reads():
    entries = {"e": TensorEntry(dtype="float32", shape=[0, 4], chunks=[])}
    plan = plan_reads(entries, [TensorSlice("e", torch.float32, (0, 4), (0, 0), (0, 4))])
    assert plan.reads == () and plan.copies == ()


def test_plan_is_a_pure_function_of_its_inputs():
    entries = stored(dp2_tp2(), 64)
    before = {n: e.model_copy(deep=True) for n, e in entries.items()}
    assert plan_reads(entries, tp4(1)) == plan_reads(entries, tp4(1))
    assert entries == before
