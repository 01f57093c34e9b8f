"""Host-memory staging buffers for a rank's checkpoint writes, kept from one save to the next.

Protocol: one `StagingPool` per `ckpt.writer.ShardWriter` (so per rank). At a checkpoint step
the writer calls `stage(pieces)` from the training thread, only after the previous save's
background write has finished (the writer joins it first: at most one snapshot is staged,
docs/design.md invariant 6), so no buffer handed out by the last call is still being read.

Why keep the buffers: the training loop is blocked while its state is copied out, and a
fresh copy of a few hundred MiB spends more time faulting in new pages than copying
(first touch of every 4 KiB page). A job saves the same slices at every checkpoint, so from
the second save on staging is a plain copy into memory that is already mapped. A slice
whose geometry or dtype changed (a new layout after a reshard) gets a new buffer; buffers no
slice asked for in the latest call are released, so the pool never holds more than one
snapshot.

Device state (CUDA tensors) is staged into pinned host memory with asynchronous copies, all
issued first and waited for once at the end of `stage` (so the copies of many tensors run
back to back on the copy engine, and the writer thread never reads a buffer still being
filled); host state is copied into ordinary memory. The copies go on the calling thread's
current stream, the one the step's kernels ran on, so they start only after every kernel
already queued (the state is final) with no event to record; the wait is a device-wide
synchronize, which between steps has nothing else to wait for.

Host-to-host copies of contiguous tensors go through the C library's `memmove`, not
`Tensor.copy_`: glibc's memmove switches to non-temporal stores above a size threshold, and
a staging copy (hundreds of MiB, read next by another thread) has no use for the cache; with
the rank's cores all copying, memory bandwidth is what staging waits for, and streaming
stores skip the read of every destination line that ordinary stores make. glibc derives the
threshold from the cache size it detects, often hundreds of MiB on virtual machines, so
`staging_env` lowers it to `NON_TEMPORAL_THRESHOLD` for the rank processes the orchestrator
starts (glibc reads tunables when a process starts). Measured here, 4 ranks copying 264 MiB
each on 2 cores: 0.058-0.061 s with it against 0.067-0.075 s for `copy_`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

import torch

from trainer.state_slices import TensorSlice

NON_TEMPORAL_THRESHOLD = 1 << 20  # copies this large stream past the cache; below, they fit in L2
_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"


def staging_env(env: Mapping[str, str]) -> dict[str, str]:
    """Environment variables to add for a rank process, given the environment it would start with.

    Sets glibc's non-temporal threshold (x86; ignored elsewhere) unless `env` already sets it;
    other tunables in `env` are kept.
    """
    tunables = env.get("GLIBC_TUNABLES", "")
    if _TUNABLE in tunables:
        return {}
    ours = f"{_TUNABLE}={NON_TEMPORAL_THRESHOLD}"
    return {"GLIBC_TUNABLES": f"{tunables}:{ours}" if tunables else ours}


def copy_into(buffer: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> None:
    """`buffer.copy_(source)`, by the C library's memmove where both are contiguous host tensors of one dtype."""
    if (buffer.device.type == "cpu" and source.device.type == "cpu" and buffer.dtype == source.dtype
            and buffer.shape == source.shape and buffer.is_contiguous() and source.is_contiguous()
            and source.layout == torch.strided and not source.is_conj() and not source.is_neg()):
        ctypes.memmove(buffer.data_ptr(), source.data_ptr(), buffer.numel() * buffer.element_size())
    else:
        buffer.copy_(source, non_blocking=non_blocking)


class StagingPool:
    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.reused = 0  # slices staged into a kept buffer, over the pool's life (for tests and reports)

    def stage(self, pieces: Sequence[TensorSlice]) -> list[TensorSlice]:
        """A CPU copy of every piece's tensor, in buffers kept for the next call; the pieces are not changed."""
        kept, staged, devices = {}, [], set()
        for piece in pieces:
            if piece.tensor is None:
                raise ValueError(f"{piece.name}{list(piece.offsets)}: a slice to save has no data")
            source = piece.tensor.detach()
            on_device = source.device.type == "cuda"
            slot = (piece.key, source.dtype, tuple(source.shape), on_device)
            if slot in kept:  # the same slice twice in one call: each needs its own copy
                raise ValueError(f"{piece.name}{list(piece.offsets)}: the same slice was staged twice")
            buffer = self._buffers.get(slot)
            if buffer is None:
                # Pinned for device sources: a pageable target would make the copy synchronous and
                # go through a bounce buffer; pinned memory is also what keeps the pool worth having.
                buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=on_device)
            else:
                self.reused += 1
            copy_into(buffer, source, non_blocking=on_device)
            if on_device:
                devices.add(source.device)
            kept[slot] = buffer
            staged.append(piece.with_tensor(buffer))
        for device in devices:  # the copies above may still be in flight
            torch.cuda.synchronize(device)
        self._buffers = kept
        return staged

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
