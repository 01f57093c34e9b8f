"""Fixed-size checksummed blocks of a stored chunk, and which blocks a partial read touches.

A chunk (one rectangular slice of a logical tensor, row-major bytes) is checksummed in
blocks of `block_bytes` (the last one may be shorter), each with its own CRC32 in the
manifest. A reader that needs part of a chunk fetches whole blocks of that part only and
verifies each one, so partial reads are verified without reading whole chunks. Blocks
are small enough that a column slice of a large chunk skips most of it, large enough
that per-request latency on object storage does not dominate.

Chunks start at `ALIGN`-byte boundaries of their shard file and `block_bytes` is a
multiple of `ALIGN`, so every fetched range begins at an offset divisible by any element
size: the reader views fetched bytes as typed tensors without copying.
"""

from __future__ import annotations

import numpy as np

from ckpt.boxes import Ints, row_major_strides, volume

try:  # zlib's CRC32, SIMD-accelerated (a dependency); the same values from the standard library where a
    from zlib_ng.zlib_ng import crc32  # machine lacks it (a GPU image's own Python running the GPU check)
except ImportError:  # pragma: no cover (zlib-ng is installed wherever undying is)
    from zlib import crc32

BLOCK_BYTES = 1 << 20  # 1 MiB: about one round trip's worth of bytes on object storage
ALIGN = 64  # chunk start alignment in a shard file; >= the largest element size (complex128: 16)


def check_block_bytes(block_bytes: int) -> int:
    if block_bytes <= 0 or block_bytes % ALIGN:
        raise ValueError(f"block size {block_bytes} must be a positive multiple of {ALIGN} bytes")
    return block_bytes


def block_count(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


def block_crcs(data, block_bytes: int) -> list[int]:
    """CRC32 of each block of `data` (any contiguous buffer).

    zlib's CRC32 (the same values as `zlib.crc32`), computed by zlib-ng with carry-less
    multiply instructions: about 5x the standard library's speed (21 vs 4 GB/s on one core
    here), which makes checksums a small part of a save's or a load's CPU time instead of
    about a third of it. Like zlib's, it releases the GIL on large buffers.
    """
    view = memoryview(data).cast("B")
    return [crc32(view[start:start + block_bytes]) for start in range(0, len(view), block_bytes)]


def touched_blocks(shape: Ints, itemsize: int, offsets: Ints, lengths: Ints, block_bytes: int) -> list[tuple[int, int]]:
    """Half-open ranges of block indices holding some element of the box, in a row-major chunk.

    `shape` is the chunk's shape; the box `(offsets, lengths)` is relative to the chunk.
    Exact: a block is listed iff at least one byte of the box lies in it.
    """
    if volume(lengths) == 0:
        return []
    ndim = len(shape)
    strides = row_major_strides(shape)
    # Dimensions after `inner` are taken whole, so each run of the box is contiguous.
    inner = ndim - 1
    while inner > 0 and offsets[inner] == 0 and lengths[inner] == shape[inner]:
        inner -= 1
    run = (lengths[inner] * strides[inner] if ndim else 1) * itemsize
    first = sum(o * s for o, s in zip(offsets, strides, strict=True)) * itemsize
    last_end = (sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True)) + 1) * itemsize
    # When no gap between consecutive runs can hold a whole block, every block from the
    # first to the last byte is touched: the common case, and O(ndim).
    if _largest_gap(strides, itemsize, lengths, inner, run) < block_bytes:
        return [(first // block_bytes, (last_end - 1) // block_bytes + 1)]
    starts = np.array([first], dtype=np.int64)
    for dim in range(inner):
        steps = np.arange(lengths[dim], dtype=np.int64) * (strides[dim] * itemsize)
        starts = (starts[:, None] + steps[None, :]).reshape(-1)  # row-major order: increasing
    lo = starts // block_bytes
    hi = (starts + run - 1) // block_bytes + 1
    breaks = np.nonzero(lo[1:] > hi[:-1])[0] + 1
    begin = np.concatenate(([0], breaks))
    end = np.concatenate((breaks - 1, [len(lo) - 1]))
    return [(int(lo[b]), int(hi[e])) for b, e in zip(begin, end, strict=True)]


def _largest_gap(strides: tuple[int, ...], itemsize: int, lengths: Ints, inner: int, run: int) -> int:
    """Largest number of bytes between the end of one run of the box and the start of the next."""
    largest = 0
    for dim in range(inner):
        if lengths[dim] < 2:
            continue  # this dimension never advances, so it opens no gap
        extent = sum((lengths[e] - 1) * strides[e] for e in range(dim + 1, inner)) * itemsize + run
        largest = max(largest, strides[dim] * itemsize - extent)
    return largest
