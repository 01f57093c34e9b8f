"""Load-time resharding: which bytes to fetch, and where each goes (pure, metadata only).

Protocol: a restoring rank (ckpt.reader) calls `plan_reads(manifest.tensors, targets)`
with the slices its new layout needs (`engine.wanted_slices()` geometry: name, global
shape, offsets, lengths). The plan says, per shard file, which byte ranges to fetch
(whole checksummed blocks, coalesced when close) and, per target slice, which region of
which stored chunk fills which region of the target. The stored layout and the target
layout are independent: any rectangular split of either side works (rows, columns, 2-D,
uneven, scalars), so dp2 x tp2 loads as tp4, as dp4 or as one process (invariant 2).

No I/O, no processes: the planner is tested on manifests alone (tests/unit/test_reshard.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckpt.blocks import touched_blocks
from ckpt.boxes import describe, intersect, relative, volume
from ckpt.manifest import Chunk, TensorEntry
from ckpt.shards import itemsize

COALESCE_GAP = 1 << 20  # fetch up to this many unneeded bytes rather than issue one more request
MAX_RANGE = 64 << 20  # never merge ranges past this size, so large reads still spread over threads


class CoverageError(ValueError):
    """The stored chunks do not cover a target slice (the manifest lacks part of a tensor)."""


@dataclass(frozen=True)
class Block:
    """One checksummed block to verify, as absolute byte offsets in its shard file."""

    start: int
    end: int
    crc32: int | None  # None: the source carries no checksum (a safetensors file)


@dataclass(frozen=True)
class RangeRead:
    """One range request: bytes [start, end) of `file`; `blocks` are the needed blocks inside it."""

    file: str
    start: int
    end: int
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class Copy:
    """Elements `lengths` at `src_offsets` of a stored chunk go to `dst_offsets` of target `target`.

    Offsets are relative to the chunk and to the target slice. The chunk's element 0 is at
    byte `chunk_start` of `file`; the chunk is row-major with shape `chunk_shape`.
    """

    target: int
    file: str
    chunk_start: int
    chunk_shape: tuple[int, ...]
    dtype: str
    src_offsets: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class ReadPlan:
    reads: tuple[RangeRead, ...]
    copies: tuple[Copy, ...]

    @property
    def bytes_to_read(self) -> int:
        return sum(r.end - r.start for r in self.reads)


def plan_reads(
    entries: Mapping[str, TensorEntry], targets: Sequence, *,
    coalesce_gap: int = COALESCE_GAP, max_range: int = MAX_RANGE,
) -> ReadPlan:
    """The read plan that fills every target slice from the stored chunks `entries`.

    `targets`: objects with `name`, `global_shape`, `offsets`, `lengths` (TensorSlice).
    Raises ValueError when a target's tensor is absent or has another global shape (the
    checkpoint does not fit the layout), and CoverageError when the chunks leave part of a
    target unstored.
    """
    copies: list[Copy] = []
    needed: dict[tuple[str, int], tuple[Chunk, list[tuple[int, int]]]] = {}
    for index, target in enumerate(targets):
        entry = _entry_for(entries, target)
        size = itemsize(entry.dtype)
        covered = 0
        for chunk in entry.chunks:
            common = intersect(target.offsets, target.lengths, chunk.offsets, chunk.lengths)
            if common is None:
                continue
            offsets, lengths = common
            _check_chunk(target.name, chunk, size)
            src = relative(offsets, chunk.offsets)
            copies.append(Copy(
                target=index, file=chunk.file, chunk_start=chunk.byte_offset, chunk_shape=tuple(chunk.lengths),
                dtype=entry.dtype, src_offsets=src, dst_offsets=relative(offsets, target.offsets), lengths=lengths,
            ))
            blocks = touched_blocks(chunk.lengths, size, src, lengths, chunk.block_bytes)
            needed.setdefault((chunk.file, chunk.byte_offset), (chunk, []))[1].extend(blocks)
            covered += volume(lengths)
        if covered != volume(target.lengths):  # more than the volume: chunks overlap (never committed so)
            raise CoverageError(
                f"{target.name}: the stored chunks cover {covered} of the {volume(target.lengths)} elements "
                f"of slice {describe(target.offsets, target.lengths)}"
                + (" (overlapping chunks)" if covered > volume(target.lengths) else "")
            )
    return ReadPlan(reads=_ranges(needed.values(), coalesce_gap, max_range), copies=tuple(copies))


def _entry_for(entries: Mapping[str, TensorEntry], target) -> TensorEntry:
    entry = entries.get(target.name)
    if entry is None:
        raise ValueError(f"{target.name}: the checkpoint has no such tensor (it holds {len(entries)} others)")
    if tuple(entry.shape) != tuple(target.global_shape):
        raise ValueError(f"{target.name}: stored with global shape {entry.shape}, "
                         f"the layout wants {list(target.global_shape)}")
    return entry


def _check_chunk(name: str, chunk: Chunk, size: int) -> None:
    if chunk.nbytes != volume(chunk.lengths) * size:
        raise CoverageError(f"{name}: chunk {describe(chunk.offsets, chunk.lengths)} in {chunk.file} "
                            f"claims {chunk.nbytes} bytes, its shape needs {volume(chunk.lengths) * size}")


def _ranges(needed, coalesce_gap: int, max_range: int) -> tuple[RangeRead, ...]:
    """Needed blocks -> absolute byte ranges per file, merged when adjacent or `coalesce_gap` apart."""
    per_file: dict[str, list[Block]] = defaultdict(list)
    for chunk, intervals in needed:
        for first, last in interval_union(intervals):
            for i in range(first, last):
                start = chunk.byte_offset + i * chunk.block_bytes
                end = min(start + chunk.block_bytes, chunk.byte_offset + chunk.nbytes)
                per_file[chunk.file].append(Block(start, end, chunk.block_crc32[i]))
    reads = []
    for file in sorted(per_file):
        group: list[Block] = []
        for block in sorted(per_file[file], key=lambda b: b.start):
            if group and (block.start - group[-1].end > coalesce_gap or block.end - group[0].start > max_range):
                reads.append(RangeRead(file, group[0].start, group[-1].end, tuple(group)))
                group = []
            group.append(block)
        if group:
            reads.append(RangeRead(file, group[0].start, group[-1].end, tuple(group)))
    return tuple(reads)


def interval_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """`intervals` as disjoint ones, in order: overlapping and touching ones joined."""
    merged: list[list[float]] = []
    for first, last in sorted(intervals):
        if merged and first <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return [(a, b) for a, b in merged]
