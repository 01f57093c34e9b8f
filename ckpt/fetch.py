"""Execute the byte-range reads of a read plan: parallel range requests, per-block CRC32 checks.

Called by ckpt.reader on the restoring rank (or by a verifying tool), after
`ckpt.reshard.plan_reads`. Object-store latency, not bandwidth, dominates small range
reads, so ranges are fetched by a pool of threads (`Storage` is safe to share), each
straight into the tensor the reader then views. Every needed block is verified against
the manifest before any byte of it is used; a missing file, a short read or a checksum
mismatch raises `CorruptCheckpoint`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ckpt.blocks import crc32
from ckpt.errors import CorruptCheckpoint
from ckpt.manifest import step_dir
from ckpt.reshard import RangeRead
from ckpt.storage import Storage

READ_THREADS = 8

Fetched = dict[str, list[tuple[int, torch.Tensor]]]  # file -> [(start byte, uint8 bytes)], sorted by start


def fetch(storage: Storage, step: int, reads: Sequence[RangeRead], *, threads: int = READ_THREADS,
          keep: bool = True) -> Fetched:
    """Read and verify every range of `reads` from checkpoint `step`'s directory.

    With `keep=False` the bytes are verified and dropped (whole-checkpoint verification
    in bounded memory); the result is then empty.
    """
    out: Fetched = defaultdict(list)
    if not reads:
        return out
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(reads))), thread_name_prefix="ckpt-read") as pool:
        futures = [pool.submit(_read_one, storage, step, read, keep) for read in reads]
        try:
            for read, future in zip(reads, futures, strict=True):
                data = future.result()
                if keep:
                    out[read.file].append((read.start, data))
        except BaseException:
            for future in futures:
                future.cancel()  # do not keep fetching from a checkpoint already known bad
            raise
    for ranges in out.values():
        ranges.sort(key=lambda item: item[0])
    return out


def _read_one(storage: Storage, step: int, read: RangeRead, keep: bool) -> torch.Tensor | None:
    path = storage.path(step_dir(step), read.file)
    # The bytes land in the tensor the reader will view (no bytes object, no second copy).
    buffer = torch.empty(read.end - read.start, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    try:
        got = storage.read_range_into(path, read.start, view)
    except OSError as err:  # FileNotFoundError included: a shard named by the manifest is gone
        raise CorruptCheckpoint(f"step {step}: cannot read bytes {read.start}..{read.end} of {read.file}: "
                                f"{type(err).__name__}: {err}") from err
    if got != len(view):
        raise CorruptCheckpoint(f"step {step}: {read.file} is truncated: got {got} of the "
                                f"{len(view)} bytes at {read.start}")
    # crc32 releases the GIL on large buffers: the pool's threads checksum one range while
    # others are still reading theirs.
    for block in read.blocks:
        if crc32(view[block.start - read.start:block.end - read.start]) != block.crc32:
            raise CorruptCheckpoint(f"step {step}: checksum mismatch in {read.file}, "
                                    f"block at bytes {block.start}..{block.end}")
    return buffer if keep else None
