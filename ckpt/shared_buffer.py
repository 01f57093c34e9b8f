"""The staging buffer a rank shares with its checkpoint writer process (ckpt.process_writer): one flat
uint8 tensor over anonymous shared memory, mapped by both.

Protocol: the rank creates it (`SharedBuffer(nbytes)`), copies a save's slices into `tensor`, and
sends `fd` to the writer over their control socket (SCM_RIGHTS), which maps it (`SharedBuffer(nbytes,
fd=...)`); `pin()` page-locks the rank's mapping for CUDA once; each side `close()`s its own.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch


class SharedBuffer:
    """A flat uint8 tensor over anonymous shared memory (memfd): mapped by the rank and its writer.

    A memfd, not a /dev/shm file: nothing is left behind when a process is killed, and its size
    is bounded by the memory limit, not by the /dev/shm mount's. The descriptor goes to the
    child over the control socket (SCM_RIGHTS).
    """

    def __init__(self, nbytes: int, fd: int | None = None):
        created = fd is None
        if created:
            fd = os.memfd_create("undying-ckpt-staging", os.MFD_CLOEXEC)
        try:
            if created:
                os.ftruncate(fd, max(nbytes, 1))
            self._map = mmap.mmap(fd, max(nbytes, 1))
        except OSError:  # out of memory, a memory limit: the memfd must not leak
            if created:
                os.close(fd)
            raise
        self.fd, self.nbytes = fd, nbytes
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]
        self.pinned = False

    def pin(self) -> bool:
        """Page-lock the mapping for CUDA (cudaHostRegister), once: device-to-host copies into it can
        then run asynchronously at full speed, as into the thread writer's pinned buffers. False
        (pageable, synchronous copies) if CUDA refuses."""
        if not self.pinned and self.nbytes:
            cudart = torch.cuda.cudart()
            self.pinned = cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0) == 0
            clear = getattr(cudart, "cudaGetLastError", None)  # (not bound by every torch build)
            if not self.pinned and clear is not None:  # the error it left pending would fail the next launch
                clear()
        return self.pinned

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self._map.close()
        os.close(self.fd)
