"""Host-memory staging buffers for a rank's checkpoint writes, kept from one save to the next.

Protocol: one `StagingPool` per `ckpt.writer.ShardWriter` (so per rank). At a checkpoint step
the writer calls `stage(pieces)` from the training thread, only after the previous save's
background write has finished (the writer joins it first: at most one snapshot is staged,
design.md invariant 6), so no buffer handed out by the last call is still being read.

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
filled); host state is copied into ordinary memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.state_slices import TensorSlice


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
            buffer.copy_(source, non_blocking=on_device)
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
