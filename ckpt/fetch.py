"""Execute the byte-range reads of a read plan: parallel range requests, per-block CRC32 checks.

Called by ckpt.reader on the restoring rank (or by a verifying tool), after
`ckpt.reshard.plan_reads`. Object-store latency, not bandwidth, dominates small range
reads, and a cold disk or a store gives its bandwidth only to many requests in flight, so
ranges are fetched by a pool of threads (`Storage` is safe to share), long ranges in pieces,
each straight into the tensor the reader then views. Every needed block is verified against
the manifest before any byte of it is used; a missing file, a short read or a checksum
mismatch raises `CorruptCheckpoint` (a block that mismatches is read once more first: one
damaged read proves nothing about the stored bytes). A read the store fails transiently (a timeout, a reset
connection, a 5xx, throttling: ckpt.storage_errors.classify) is retried with backoff until the
failures took the `retry` budget, shared by all pieces, and then raises
`TransientStorageError`, which proves nothing about the bytes; other storage errors
(permission denied) pass through as they are.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ckpt.blocks import crc32
from ckpt.errors import TransientStorageError, corrupt_at
from ckpt.manifest import step_dir
from ckpt.reshard import RangeRead
from ckpt.storage import Storage
from ckpt.storage_errors import CORRUPT, ReadRetry, classify

READ_THREADS = 8
# Ranges longer than this are read as several pieces by the pool's threads at once, into one
# buffer: a restoring rank often needs a single range per file (hundreds of MiB), and one
# sequential read of it keeps one request in flight, while a cold disk or an object store
# gives its bandwidth only to many (the kernel's read-ahead is 128 KiB by default; a ranged
# GET is one connection).
PIECE_BYTES = 16 << 20

Fetched = dict[str, list[tuple[int, torch.Tensor]]]  # file -> [(start byte, uint8 bytes)], sorted by start


def fetch(storage: Storage, step: int | None, reads: Sequence[RangeRead], *, threads: int = READ_THREADS,
          keep: bool = True, piece_bytes: int = PIECE_BYTES, retry: ReadRetry | None = None,
          on_bytes: Callable[[int, int], None] | None = None) -> Fetched:
    """Read and verify every range of `reads` from checkpoint `step`'s directory (`step` None: from
    the storage root, as for a Hugging Face model directory; blocks whose crc32 is None, which
    safetensors files do not carry, are read unverified).

    Each range is read into one buffer, as pieces of at most `piece_bytes` fetched
    concurrently; once a range's pieces are all in, the thread that brought the last one
    checks its blocks. With `keep=False` the bytes are verified and dropped (whole-checkpoint
    verification in bounded memory); the result is then empty. `retry`: how transient read
    errors are retried, one budget for every piece and for whatever else the caller read
    through it (default: a new ReadRetry(), checkpoint.read_retry_s's default budget).
    `on_bytes(n, total)`: called on the caller's thread, in order, as each piece of n bytes is
    in (`total`: the bytes of every range), so a command can show its progress.
    """
    out: Fetched = defaultdict(list)
    if not reads:
        return out
    retry = retry if retry is not None else ReadRetry()
    ranges = [_Range(storage, step, read, piece_bytes, retry) for read in reads]
    pieces = [(r, lo, hi) for r in ranges for lo, hi in r.pieces]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(pieces))), thread_name_prefix="ckpt-read") as pool:
        # Ranges in order, so a range's buffer is allocated only when its first piece is read:
        # with keep=False at most the ranges in flight are held.
        futures = [pool.submit(r.read_piece, lo, hi, keep) for r, lo, hi in pieces]
        total = sum(hi - lo for _, lo, hi in pieces)
        try:
            for future, (_, lo, hi) in zip(futures, pieces, strict=True):
                future.result()
                if on_bytes is not None:
                    on_bytes(hi - lo, total)
        except BaseException:
            for future in futures:
                future.cancel()  # do not keep fetching from a checkpoint already known bad
            raise
    if keep:
        for r in ranges:
            out[r.read.file].append((r.read.start, r.buffer))
        for file_ranges in out.values():
            file_ranges.sort(key=lambda item: item[0])
    return out


class _Range:
    """One `RangeRead` being fetched: its buffer, its pieces, and the count of pieces still out."""

    def __init__(self, storage: Storage, step: int | None, read: RangeRead, piece_bytes: int, retry: ReadRetry):
        self.storage, self.step, self.read, self.retry = storage, step, read, retry
        self.where = f"step {step}" if step is not None else storage.root
        size = read.end - read.start
        self.pieces = [(lo, min(lo + piece_bytes, size)) for lo in range(0, size, piece_bytes)] or [(0, 0)]
        self.buffer: torch.Tensor | None = None
        self._left = len(self.pieces)
        self._lock = threading.Lock()

    def read_piece(self, lo: int, hi: int, keep: bool) -> None:
        read = self.read
        with self._lock:
            if self.buffer is None:
                # The bytes land in the tensor the reader will view (no bytes object, no second copy).
                self.buffer = torch.empty(read.end - read.start, dtype=torch.uint8)
            buffer = self.buffer
        view = memoryview(buffer.numpy())
        self._read_into(view, lo, hi)
        with self._lock:
            self._left -= 1
            if self._left:
                return
        # The last piece is in: check every block of the range. crc32 releases the GIL on large
        # buffers, so other threads go on reading meanwhile.
        for block in read.blocks:
            if block.crc32 is None:
                continue
            lo, hi = block.start - read.start, block.end - read.start
            if crc32(view[lo:hi]) == block.crc32:
                continue
            # One bad read proves nothing about the stored bytes (a proxy, a NIC, a ranged GET has
            # no end-to-end checksum): the block is read again, and only a second mismatch is proof.
            self._read_into(view, lo, hi)
            if crc32(view[lo:hi]) != block.crc32:
                raise corrupt_at(f"{self.where}: checksum mismatch in {read.file}, block at bytes "
                                 f"{block.start}..{block.end} (read twice)", read.file, block.start, block.end)
        if not keep:
            self.buffer = None

    def _read_into(self, view: memoryview, lo: int, hi: int) -> None:
        """Bytes lo..hi of the range into `view[lo:hi]`, one request (retried when the store fails
        transiently); a missing or short file is CorruptCheckpoint."""
        read = self.read
        path = self.storage.path(step_dir(self.step), read.file) if self.step is not None \
            else self.storage.path(read.file)
        what = f"{self.where}: bytes {read.start + lo}..{read.start + hi} of {read.file}"
        try:
            got = self.retry.call(lambda: self.storage.read_range_into(path, read.start + lo, view[lo:hi]), what)
        except TransientStorageError:
            raise
        except Exception as err:
            if classify(err) != CORRUPT:  # not proof: the caller must not take the checkpoint for bad
                raise
            # A shard the committed manifest names is gone, or shorter than the range (S3 416).
            raise corrupt_at(f"{what} cannot be read: {type(err).__name__}: {err}", read.file, read.start + lo,
                             read.start + hi) from err
        if got != hi - lo:
            raise corrupt_at(f"{self.where}: {read.file} is truncated: got {got} of the {hi - lo} bytes at "
                             f"{read.start + lo}", read.file, read.start + lo, read.start + hi)
