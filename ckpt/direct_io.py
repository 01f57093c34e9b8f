"""Local shard files written with O_DIRECT: bytes go from our buffer to the disk, not through the page cache.

Protocol: `ckpt.storage` opens the temporary file of every local `atomic_writer` with
`open_direct`; where the filesystem accepts O_DIRECT it wraps the descriptor in a
`DirectFile`, the shard writer calls `write` chunk after chunk, and the storage calls
`finish()` (last bytes, true length, fsync) before renaming the file into place, or
`abort()` if the block failed. Where O_DIRECT is refused (tmpfs, non-Linux) the storage
falls back to a buffered file with early writeback (`ckpt.write_behind`).

Why: a buffered write copies every byte into freshly allocated page-cache pages and the
final fsync then waits for all of them; a checkpoint is written once and read back, if
ever, after a failure on another machine, so caching it only evicts what training reads.
O_DIRECT writes go from an aligned user buffer straight to the device. `write` copies the
caller's bytes into one of two page-aligned buffers (`BUFFER_BYTES` each); a full buffer is
handed to one I/O thread while the caller fills the other, so checksumming and gathering
the next chunk overlap the device writing the last one (the thread releases the GIL in
`os.write`). The copy replaces the one a buffered write makes into the page cache.

O_DIRECT needs the buffer address, the length and the file offset aligned to the logical
block size: the buffers are mmap'ed (page-aligned) and every write but the last is a full
buffer; the last is padded with zeros to `ALIGN_BYTES` and the file is then truncated to
its true length. A device that still answers EINVAL (a larger block size) gets the
descriptor switched to buffered I/O (`fcntl F_SETFL`) and the write retried, so the
file is correct either way. Durability comes from the fsync in `finish`, as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor

ALIGN_BYTES = 4096  # covers 512-byte and 4 KiB logical blocks
BUFFER_BYTES = 8 << 20  # per buffer; two per open file
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def open_direct(path: str) -> int | None:
    """A new file at `path` opened for O_DIRECT writing, or None where the filesystem refuses it."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o644)
    except OSError as err:
        if err.errno == errno.EINVAL:  # tmpfs and friends: no O_DIRECT
            return None
        raise


class DirectFile:
    """Write-only sequential file over an O_DIRECT descriptor it owns (closed by `finish` or `abort`)."""

    def __init__(self, fd: int, buffer_bytes: int = BUFFER_BYTES):
        if buffer_bytes <= 0 or buffer_bytes % ALIGN_BYTES:
            raise ValueError(f"buffer_bytes {buffer_bytes} must be a positive multiple of {ALIGN_BYTES}")
        self._fd = fd
        self._buffers = [mmap.mmap(-1, buffer_bytes) for _ in range(2)]
        self._views = [memoryview(b) for b in self._buffers]
        self._current = 0  # index of the buffer `write` fills
        self._fill = 0  # bytes in the current buffer
        self._size = 0  # bytes accepted by `write`
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-direct-io")
        self._pending: Future | None = None  # the other buffer's write, if in flight
        self.direct = True  # False once the descriptor fell back to buffered I/O

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        view, pos = self._views[self._current], 0
        while pos < len(data):
            take = min(len(data) - pos, len(view) - self._fill)
            view[self._fill:self._fill + take] = data[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == len(view):
                self._hand_off()
                view = self._views[self._current]
        self._size += len(data)
        return len(data)

    def _hand_off(self) -> None:
        """Queue the full current buffer for writing and switch to the other one (after its write is done)."""
        self._wait()
        self._pending = self._io.submit(self._write_all, self._views[self._current][:self._fill])
        self._current ^= 1
        self._fill = 0

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises the I/O thread's error here, in the writer

    def _write_all(self, view: memoryview) -> None:
        while len(view):
            try:
                written = os.write(self._fd, view)
            except OSError as err:
                if err.errno != errno.EINVAL or not self.direct:
                    raise
                self._to_buffered()
                continue
            view = view[written:]
            if len(view) and written % ALIGN_BYTES and self.direct:
                self._to_buffered()  # a short, unaligned write: the rest can no longer be aligned

    def _to_buffered(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self.direct = False

    def finish(self) -> None:
        """Write what is left, cut the file to its true length, fsync, close."""
        try:
            self._wait()
            tail, view = self._fill, self._views[self._current]
            if tail:
                padded = tail if not self.direct else -(-tail // ALIGN_BYTES) * ALIGN_BYTES
                view[tail:padded] = bytes(padded - tail)
                self._write_all(view[:padded])
            # Cut the zero padding off; also when the padded write itself fell back to buffered I/O.
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        finally:
            self._close()

    def abort(self) -> None:
        """Stop without finishing (the caller removes the file)."""
        try:
            if self._pending is not None:
                self._pending.exception()  # wait, but the caller's error is the one that matters
        finally:
            self._close()

    def _close(self) -> None:
        self._io.shutdown(wait=True)
        for view in self._views:
            view.release()
        for buffer in self._buffers:
            # After an I/O error the traceback still holds slices of a buffer; it is then
            # unmapped when the last of them goes.
            with contextlib.suppress(BufferError):
                buffer.close()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    @property
    def size(self) -> int:
        return self._size

    def fileno(self) -> int:
        return self._fd
