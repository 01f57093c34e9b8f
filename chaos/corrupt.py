"""Silent corruption of a committed checkpoint: one bit of one shard flipped, the manifest left as is.

Models bit rot or a bad disk after the commit (`corrupt_shard` fault kind). Protocol: the
controller (or a test) calls `corrupt_shard(storage, step, seed)` on a committed step; the
next `ckpt.reader.verify_checkpoint` or restore of that step must raise `CorruptCheckpoint`
and `newest_loadable` must fall back to the previous committed step. The flipped bit lies
inside a byte range the manifest names (padding between chunks is never checked by
anyone, so flipping it would test nothing), chosen by a generator seeded with (seed, step).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ckpt.catalog import Catalog
from ckpt.manifest import step_dir


@dataclass(frozen=True)
class Corruption:
    """Where the bit was flipped."""

    step: int
    file: str  # shard file name inside the checkpoint directory
    path: str  # its full storage path
    byte: int  # offset of the changed byte in the file
    bit: int  # 0..7, the bit flipped in that byte
    tensor: str  # the logical tensor whose stored bytes contain it


def corrupt_shard(storage, step: int, seed: int = 0) -> Corruption:
    """Flip one bit of a shard of committed checkpoint `step` in `storage` (a ckpt.storage.Storage).

    Raises FileNotFoundError when `step` has no committed manifest and ValueError when the
    checkpoint stores no bytes. The shard is rewritten through `storage.write_immutable`,
    so faults installed on `storage` apply to it too.
    """
    manifest = Catalog(storage).read_manifest(step)
    spans = sorted(
        (chunk.file, chunk.byte_offset, chunk.nbytes, name)
        for name, entry in manifest.tensors.items() for chunk in entry.chunks if chunk.nbytes > 0
    )
    total = sum(nbytes for _, _, nbytes, _ in spans)
    if total == 0:
        raise ValueError(f"checkpoint step {step} stores no bytes; there is nothing to corrupt")
    rng = random.Random(f"undying.corrupt:{seed}:{step}")
    pick, bit = rng.randrange(total), rng.randrange(8)
    for span in spans:
        if pick < span[2]:
            break
        pick -= span[2]
    file, offset, _, name = span
    path = storage.path(step_dir(step), file)
    data = bytearray(storage.read(path))
    data[offset + pick] ^= 1 << bit
    storage.write_immutable(path, bytes(data))
    return Corruption(step=step, file=file, path=path, byte=offset + pick, bit=bit, tensor=name)
