"""Rank side of a save: who writes which tensor, and the shard file format.

Protocol: at a checkpoint step every rank calls `owned_by(rank, ...)` (pure, identical on
every rank, no communication) to learn which replicated tensors it writes, then
`write_shard(...)`, which returns a `ShardReceipt` that the rank hands to the controller.
The controller commits the manifest once every rank's receipt is in (`ckpt.commit`).

A shard file is the raw bytes of its tensors back to back (never pickle); each chunk's
byte range and CRC32 live in the receipt and then in the manifest.
"""

from __future__ import annotations

import time
import zlib

import torch

from ckpt.manifest import Chunk, ShardReceipt, TensorEntry, step_dir
from ckpt.storage import Storage


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint manifest")
    return dtype


def tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype_from_name(dtype)).reshape(shape).clone()


def owned_by(rank: int, world_size: int, sizes: dict[str, int]) -> set[str]:
    """Names of replicated tensors that `rank` writes: each written once, bytes spread evenly.

    Greedy largest-first onto the least-loaded rank; ties broken by name and rank so every
    rank computes the same assignment without talking to the others.
    """
    load = [0] * world_size
    mine: set[str] = set()
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = min(range(world_size), key=lambda r: (load[r], r))
        load[target] += sizes[name]
        if target == rank:
            mine.add(name)
    return mine


def shard_file_name(rank: int) -> str:
    return f"shard-r{rank:05d}.bin"


def write_shard(
    storage: Storage, step: int, rank: int, tensors: dict[str, torch.Tensor], blocking_s: float
) -> ShardReceipt:
    """Write this rank's tensors (whole tensors, offsets 0) as one immutable shard file."""
    started = time.perf_counter()
    file = shard_file_name(rank)
    parts: list[bytes] = []
    entries: dict[str, TensorEntry] = {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        data = tensor_bytes(t)
        shape = list(t.shape)
        chunk = Chunk(
            offsets=[0] * len(shape), lengths=shape, file=file,
            byte_offset=offset, nbytes=len(data), crc32=zlib.crc32(data),
        )
        entries[name] = TensorEntry(dtype=dtype_name(t.dtype), shape=shape, chunks=[chunk])
        parts.append(data)
        offset += len(data)
    storage.write_immutable(storage.path(step_dir(step), file), b"".join(parts))
    return ShardReceipt(
        step=step, rank=rank, file=file, nbytes=offset, tensors=entries,
        blocking_s=blocking_s, write_s=time.perf_counter() - started,
    )
