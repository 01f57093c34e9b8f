"""Start the disk writeback of a local file while it is still being written.

Protocol: `ckpt.storage` wraps the temporary file of every local `atomic_writer` in a
`WriteBehindFile`; the shard writer calls `write` chunk after chunk; the storage then
flushes and fsyncs the file before renaming it into place, exactly as without the wrapper.

Why: a shard of a few hundred MiB fits in the page cache below the kernel's dirty
threshold, so without help nothing reaches the disk until the final fsync, and the disk
idles while the writer checksums and copies, then the writer idles while the disk works.
Every `WRITE_BEHIND_BYTES` the wrapper asks the kernel to start writing the range just
written (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`: it queues the pages for writeback
and returns without waiting), so the two overlap and the fsync finds little left to do.
It only changes when dirty pages are written, never what or whether: durability still
comes from the fsync. Where the call does not exist (not Linux) the wrapper only counts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import BinaryIO

WRITE_BEHIND_BYTES = 32 << 20  # large enough that each call queues a long sequential run
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of dirty pages in the range, do not wait


def _sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_start_writeback = _sync_file_range()


class WriteBehindFile:
    """A binary file whose written bytes are handed to the disk every `every` bytes."""

    def __init__(self, file: BinaryIO, every: int | None = None):
        self._file = file
        self._every = WRITE_BEHIND_BYTES if every is None else every  # 0: never
        self._written = 0  # bytes handed to `write`
        self._queued = 0  # bytes [0, _queued) already queued for writeback
        self.calls = 0  # writeback requests made (for tests)

    def write(self, data) -> int:
        n = self._file.write(data)
        self._written += n
        if self._every > 0 and self._written - self._queued >= self._every:
            self._queue()
        return n

    def _queue(self) -> None:
        self._file.flush()  # the bytes must be in the kernel before it can write them
        if _start_writeback is not None:
            # A hint: if the kernel refuses (an odd filesystem), the fsync still does the work.
            _start_writeback(self._file.fileno(), self._queued, self._written - self._queued, _SYNC_FILE_RANGE_WRITE)
        self.calls += 1
        self._queued = self._written

    def __getattr__(self, name: str):
        return getattr(self._file, name)
